//! `mpiflow topo`: this node's topology and each rank's binding.

use serde_json::json;

use mpiflow::transport::stack;

use crate::args::{Format, TopoArgs};
use crate::out::{emit, Failure};

pub(crate) fn run(args: &TopoArgs) -> Result<(), Failure> {
    use mpiflow::topology::{cpu_list, pin, Machine};
    let (ctx, _) = super::init(false)?;
    let host = ctx.host();
    let hosts = ctx.all_gather_strings(&host);
    let locals = mpiflow::cluster::mapping::local_ranks(&hosts);
    let machine = ctx
        .agree(Machine::detect())
        .map_err(|e| Failure::agreed(e, &ctx))?;
    // Planned per machine: hosts that are containers of one machine share its cores.
    let (local, count) = ctx.machine_local();
    let p = pin(local, count, args.bind);
    // What carries one-sided traffic on this node: RDMA ports and UCX's transports.
    let rdma = stack::rdma_ports(std::path::Path::new("/sys/class/infiniband"));
    let ucx = stack::ucx_transports();
    let line = json!({
        "rank": ctx.rank(), "host": host, "local_rank": locals[ctx.rank()], "cpus": cpu_list(&p.cpus),
        "blas_threads": p.blas_threads, "bound_by": p.bound_by, "warning": p.warning,
        "rdma": rdma, "ucx_transports": ucx,
    })
    .to_string();
    if args.format == Format::Json {
        emit(&(line + "\n"));
        return Ok(());
    }
    let lines = ctx.all_gather_strings(&line);
    if ctx.rank() == 0 {
        let ports: Vec<String> = rdma.iter().map(|p| p.to_string()).collect();
        let ucx = match &ucx {
            Some(t) => t.join(", "),
            None => "ucx_info not found (Debian: ucx-utils)".into(),
        };
        let mut out = format!(
            "# node {host}: {}\n# rdma: {}; UCX transports: {ucx}\n{:<5} {:<12} {:<5} {:<12} {:<5} {}\n",
            machine.summary(),
            match ports.is_empty() {
                true => "no device (/sys/class/infiniband)".to_string(),
                false => ports.join(", "),
            },
            "rank",
            "host",
            "local",
            "cpus",
            "blas",
            "bound by"
        );
        for l in lines {
            let v: serde_json::Value = serde_json::from_str(&l).expect("our own JSON");
            let s = |k: &str| {
                v[k].as_str()
                    .map_or_else(|| v[k].to_string(), str::to_string)
            };
            out.push_str(&format!(
                "{:<5} {:<12} {:<5} {:<12} {:<5} {}",
                s("rank"),
                s("host"),
                s("local_rank"),
                s("cpus"),
                s("blas_threads"),
                s("bound_by")
            ));
            if let Some(w) = v["warning"].as_str() {
                out.push_str(&format!(" (warning: {w})"));
            }
            out.push('\n');
        }
        emit(&out);
    }
    Ok(())
}
