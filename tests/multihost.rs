//! Three hosts on one machine (network namespaces h1, h2, h3, see `tests/netns/cluster.sh`),
//! `mpirun --hostfile` across them: `spread` puts the ps tasks on different hosts and every
//! address is on the host of its rank. Needs root (CI has it); the namespaces are removed
//! even when the run fails.

mod common;

use std::collections::BTreeSet;

use common::{mpiflow, run_bounded};
use serde_json::Value;

/// The script that builds the three hosts, or `None` (the test is skipped, or fails where
/// required: [`common::as_root`]) when not root: network namespaces need it.
fn cluster_script() -> Option<String> {
    if !common::as_root("the multi-host test (network namespaces)") {
        return None;
    }
    Some(format!("{}/tests/netns/cluster.sh", common::root()))
}

/// `bash -c INNER` inside the three hosts (made before, removed after) built by `script`
/// ([`cluster_script`]), under `timeout SECS`.
fn on_hosts(script: &str, secs: u32, inner: &str) -> common::Run {
    run_bounded(secs, &[script, "with", "--", "bash", "-c", inner], &[])
}

/// For the tests of MPI programs under `launch`: the cluster's script and
/// `launcher/examples/mpi_allreduce.c` built into a directory named after `name` (kept
/// alive by the caller), or `None` as [`cluster_script`] says.
fn mpi_program_on_hosts(name: &str) -> Option<(String, common::TempDir, String)> {
    let script = cluster_script()?;
    let dir = common::tmpdir(name);
    let program = common::mpi_program(&dir);
    Some((script, dir, program))
}

#[test]
fn spread_places_ps_on_distinct_namespace_hosts() {
    let Some(script) = cluster_script() else {
        return;
    };
    let m = mpiflow();
    let inner = format!(
        "set -e; \
         mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 6 {m} spec --ps 3 --placement spread --format json; \
         echo '=== table'; \
         mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 6 {m} spec --ps 3 --placement spread; \
         echo '=== block'; \
         mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 6 {m} spec --ps 2 --format json"
    );
    let run = on_hosts(&script, 240, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    let (spread, rest) = run.stdout.split_once("=== table").expect("table marker");
    let (table, block) = rest.split_once("=== block").expect("block marker");
    let parse = |text: &str| -> Vec<Value> {
        let mut v: Vec<Value> = text
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        v.sort_by_key(|l| l["rank"].as_u64());
        v
    };
    let spread = parse(spread);
    assert_eq!(spread.len(), 6, "{run:?}");
    for (r, l) in spread.iter().enumerate() {
        // By-slot mapping over `h1 slots=2, h2 slots=2, h3 slots=2`, hosts as MPI saw them.
        let want_host = format!("h{}", r / 2 + 1);
        assert_eq!(l["host"].as_str(), Some(want_host.as_str()), "rank {r}");
        let addr = l["address"].as_str().unwrap();
        assert!(
            addr.starts_with(&format!("{want_host}:")),
            "rank {r} address {addr}"
        );
        assert_eq!(l["cluster"], spread[0]["cluster"]);
    }
    let ps_hosts: BTreeSet<&str> = spread
        .iter()
        .filter(|l| l["task"]["type"] == "ps")
        .map(|l| l["host"].as_str().unwrap())
        .collect();
    assert_eq!(ps_hosts, ["h1", "h2", "h3"].into_iter().collect());
    assert!(
        table.contains("6 tasks on 3 hosts: ps=3 worker=3"),
        "{table}"
    );
    // Block placement for contrast: both ps on h1.
    let block = parse(block);
    let block_ps: Vec<&str> = block
        .iter()
        .filter(|l| l["task"]["type"] == "ps")
        .map(|l| l["host"].as_str().unwrap())
        .collect();
    assert_eq!(block_ps, ["h1", "h1"]);
    // Nothing left behind.
    let left = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains("mpiflow-h"),
        "namespaces left behind"
    );
}

#[test]
fn ranks_of_hosts_that_are_one_machine_are_unbound_from_a_shared_core_and_pinned_apart() {
    let Some(script) = cluster_script() else {
        return;
    };
    let m = mpiflow();
    // Two ranks, one per host: each host's orted binds its rank to core 0 (Open MPI binds
    // to cores up to 2 ranks), so both share one CPU of this machine. With --bind-to none
    // there is nothing to undo.
    let topo = |extra: &str| {
        format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 2 --map-by node \
             {extra} --report-bindings {m} topo --format json"
        )
    };
    let inner = format!(
        "set -e; {}; echo '=== none' >&2; echo '=== none'; {}",
        topo(""),
        topo("--bind-to none")
    );
    let run = on_hosts(&script, 120, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    let (bound_err, none_err) = run.stderr.split_once("=== none").expect("marker");
    let (bound_out, none_out) = run.stdout.split_once("=== none").expect("marker");
    // The launcher did bind both to core 0 ...
    for r in 0..2 {
        assert!(
            bound_err.contains(&format!("MCW rank {r} bound to socket 0[core 0[hwt 0]]")),
            "{bound_err}"
        );
    }
    // ... mpiflow said so once ...
    let said = "mpiflow: warning: hosts h1, h2 are one machine (containers or namespaces) \
                whose launchers bound ranks 0, 1 to the same CPUs (0)";
    assert_eq!(bound_err.matches(said).count(), 1, "{bound_err}");
    assert!(
        bound_err.contains("mpiflow unbound them (mpirun --bind-to none avoids this)"),
        "{bound_err}"
    );
    assert!(!none_err.contains("mpiflow: warning"), "{none_err}");
    // ... and each run pins the two ranks to different CPUs, planned per machine.
    for out in [bound_out, none_out] {
        let mut cpus: Vec<(u64, String)> = out
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|v| {
                (
                    v["rank"].as_u64().unwrap(),
                    v["cpus"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        cpus.sort();
        assert_eq!(cpus, [(0, "0".to_string()), (1, "1".to_string())], "{out}");
    }
}

#[test]
fn one_sided_ps_over_tcp_between_hosts_matches_the_two_sided_ps_on_pt2pt_and_ucx() {
    let Some(script) = cluster_script() else {
        return;
    };
    let dir = common::tmpdir("netns-rma");
    let (p2p, rma, ucx) = (
        dir.join("p2p.bin"),
        dir.join("rma.bin"),
        dir.join("ucx.bin"),
    );
    let m = mpiflow();
    // No `--mca osc` given: mpiflow picks the one-sided component itself (no RDMA device
    // here, so OpenMPI's emulation over the TCP messages between the hosts), or UCX over
    // TCP when told to (`--rdma-stack ucx`).
    let train = |transport: &str, stack: &str, out: &std::path::Path| {
        format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 4 --map-by node \
             {m} --rdma-stack {stack} train --mode ps --ps 1 --transport {transport} \
             --steps 30 --log-every 10 --save-params {}",
            out.display()
        )
    };
    // The RMA layer and every collective on UCX's TCP transport, one rank per host.
    let check = format!(
        "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 3 --map-by node \
         {m} check --ps 1 --rdma-stack ucx"
    );
    // Async SGD on UCX between the hosts, racy by design: the bar of the async runs on
    // one node (2000 steps, ~13 s at UCX's TCP speed here; on one node 1500 steps read
    // 0.964-0.969, 3000 read 0.978).
    let async_ucx = format!(
        "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 4 --map-by node \
         {m} --rdma-stack ucx train --mode ps --ps 1 --transport rma --async \
         --optimizer sgd --lr 0.1 --steps 2000 --log-every 1000"
    );
    let inner = format!(
        "set -e; {}; {}; {}; {check}; echo '=== async'; {async_ucx}",
        train("p2p", "auto", &p2p),
        train("rma", "auto", &rma),
        train("rma", "ucx", &ucx)
    );
    let run = on_hosts(&script, 300, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    let (_, async_out) = run.stdout.split_once("=== async").expect("async marker");
    let acc = common::accuracy(async_out);
    assert!(
        acc >= 0.95,
        "async on UCX between hosts: {acc}\n{async_out}"
    );
    assert!(
        run.stdout
            .contains("# one-sided: no RDMA device, so OpenMPI's osc sm,pt2pt"),
        "{}",
        run.stdout
    );
    // Open MPI 4's osc pt2pt refuses MPI_THREAD_MULTIPLE, so the stall watch is off for the
    // one-sided run, said once; the two-sided run keeps it.
    let off = "refuse MPI_THREAD_MULTIPLE; no stall reports (--stall-warning)";
    assert_eq!(run.stderr.matches(off).count(), 1, "{}", run.stderr);
    for (name, params) in [("osc pt2pt", &rma), ("osc ucx", &ucx)] {
        let worst = common::max_relative_difference(&p2p, params);
        assert!(worst < 1e-4, "p2p and {name} parameters differ by {worst}");
    }
    assert!(
        run.stdout.contains("# one-sided: osc ucx"),
        "{}",
        run.stdout
    );
    assert!(
        run.stderr.contains("checks passed on each of 3 ranks"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_launched_tf1_job_across_hosts_ends_with_its_workers() {
    let Some(script) = cluster_script() else {
        return;
    };
    let checker = format!("{}/launcher/examples/check_role.py", common::root());
    let m = mpiflow();
    // One task per host: ps:0 blocks forever (as server.join()), the workers end after 1 s
    // (worker:1 with status 3 in the second job); the launchers agree across the hosts.
    let launch = |extra: &str| {
        format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 3 --map-by node \
             {m} launch --ps 1 -- python3 {checker} --join --sleep 1 {extra}"
        )
    };
    let inner = format!(
        "{}; echo \"status $?\"; {}; echo \"status $?\"",
        launch(""),
        launch("--exit worker:1=3")
    );
    let t = std::time::Instant::now();
    let run = on_hosts(&script, 240, &inner);
    assert!(t.elapsed().as_secs() < 120, "{run:?}");
    let statuses: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("status "))
        .collect();
    assert_eq!(statuses, ["status 0", "status 3"], "{run:?}");
    assert!(
        run.stderr
            .contains("every worker and chief task is done; stopping ps:0"),
        "{run:?}"
    );
    assert!(
        run.stderr
            .contains("worker:1 (rank 2) exited with status 3; stopping the job's other tasks"),
        "{run:?}"
    );
    let hosts: std::collections::BTreeSet<String> = run
        .json_lines()
        .iter()
        .map(|l| {
            l["address"]
                .as_str()
                .unwrap()
                .split(':')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(hosts.len(), 3, "one task per host: {run:?}");
}

#[test]
fn allreduce_in_two_levels_across_hosts_checks_and_trains_as_local_training() {
    let Some(script) = cluster_script() else {
        return;
    };
    let dir = common::tmpdir("netns-hier");
    let local = dir.join("local.bin");
    common::train_local_reference("60", &local, &[]);
    let m = mpiflow();
    // By slot over `h1 slots=2, h2 slots=2, h3 slots=2`: 5 ranks are h1 h1 h2 h2 h3, nodes
    // of unequal size; 4 ranks are two hosts of two.
    let check =
        format!("mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 5 {m} check");
    let params = |algo: &str| dir.join(format!("{algo}.bin"));
    let train = |algo: &str| {
        format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 4 {m} train \
             --mode allreduce --allreduce-algorithm {algo} --steps 60 --log-every 20 \
             --save-params {}",
            params(algo).display()
        )
    };
    let inner = format!(
        "set -e; {check}; {}; {}",
        train("hierarchical"),
        train("ring")
    );
    let run = on_hosts(&script, 300, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    // More ranks than this machine's CPUs, on hosts whose launchers each see their own
    // slots: mpiflow makes MPI yield while waiting, and says so once per job.
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if cpus < 4 {
        let said = format!(
            "mpiflow: warning: hosts h1, h2, h3 are one machine with {cpus} CPUs for 5 ranks, \
             which no launcher sees; mpiflow made MPI yield the CPU while waiting"
        );
        assert_eq!(run.stderr.matches(&said).count(), 1, "{}", run.stderr);
        assert_eq!(
            run.stderr.matches("are one machine with").count(),
            3,
            "{}",
            run.stderr
        );
    }
    let lines = run.json_lines();
    assert_eq!(lines.len(), 5, "{run:?}");
    for l in &lines {
        assert_eq!(l["failures"], serde_json::json!([]), "{l}");
        assert_eq!(l["digest"], lines[0]["digest"], "{l}");
        // Two levels ran (not the flat fallback of one node), and no shared memory
        // spans the hosts.
        assert_eq!(l["hierarchical"], serde_json::json!(true), "{l}");
        assert_eq!(l["shm"], serde_json::json!(false), "{l}");
        // Each rank has a neighbour on another host (h1 h1 h2 h2 h3): that channel is on
        // MPI (a channel within h1 or h2 may take rings; the check matches both sides).
        assert_eq!(l["rings"], serde_json::json!(false), "{l}");
        // The link stream's link from the left neighbour is on a ring exactly where that
        // neighbour runs on the same host (ranks 1 and 3).
        let rank = l["rank"].as_u64().unwrap();
        let same_host = rank == 1 || rank == 3;
        assert_eq!(l["link_rings"], serde_json::json!(same_host), "{l}");
    }
    assert!(
        run.stdout.contains("algorithm hierarchical"),
        "{}",
        run.stdout
    );
    for algo in ["hierarchical", "ring"] {
        let worst = common::max_relative_difference(&local, &params(algo));
        assert!(
            worst < 1e-4,
            "{algo} across hosts: largest relative difference {worst}"
        );
    }
}

#[test]
fn pipelines_across_hosts_keep_replicas_inside_hosts_and_train_as_local_training() {
    let Some(script) = cluster_script() else {
        return;
    };
    let dir = common::tmpdir("netns-pipeline");
    let local = dir.join("local.bin");
    common::train_local_reference("60", &local, &["--hidden", "64,32"]);
    let m = mpiflow();
    let params = |name: &str| dir.join(format!("{name}.bin"));
    let train = |name: &str, np: usize, mode: &str| {
        format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np {np} {m} train \
             {mode} --stages 2 --hidden 64,32 --steps 60 --log-every 30 --save-params {}",
            params(name).display()
        )
    };
    // 6 ranks, 2 a host: a replica of 2 stages on each host, its stages' gradients summed
    // across the hosts. 5 ranks and a ps: h2 holds a whole replica; h1's and h3's leftover
    // ranks make the other, its pipeline between hosts.
    let inner = format!(
        "set -e; {}; {}",
        train("allreduce", 6, "--mode allreduce"),
        train("ps", 5, "--mode ps --ps 1")
    );
    let run = on_hosts(&script, 300, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    for ranks in [
        "# ranks: 0=replica_0:0 1=replica_0:1 2=replica_1:0 3=replica_1:1 4=replica_2:0 5=replica_2:1",
        "# ranks: 0=ps:0 1=replica_0:0 2=replica_1:0 3=replica_1:1 4=replica_0:1",
    ] {
        assert!(run.stdout.contains(ranks), "{}", run.stdout);
    }
    for name in ["allreduce", "ps"] {
        let worst = common::max_relative_difference(&local, &params(name));
        assert!(worst < 1e-4, "{name}: largest relative difference {worst}");
    }
}

/// A program that initialises MPI itself, launched across the three hosts: `launch
/// --hostfile` (the one mpirun was given) learns the cluster from it and the rank from
/// mpirun's variables, without MPI, so the program's own `MPI_Init` spans the hosts.
#[test]
fn an_mpi_program_launched_across_hosts_by_the_hostfile_initialises_mpi_itself() {
    let Some((script, _dir, program)) = mpi_program_on_hosts("multihost-mpi-program") else {
        return;
    };
    let (m, hosts) = (mpiflow(), "hostfiles/netns-3hosts");
    let inner = format!(
        "mpirun $MPIFLOW_NETNS_MCA --hostfile {hosts} -np 6 {m} launch --hostfile {hosts} -- {program}"
    );
    let run = on_hosts(&script, 240, &inner);
    assert_eq!(run.code, 0, "{run:?}");
    let tasks: Vec<String> = (0..6).map(|r| format!("worker:{r}")).collect();
    common::assert_mpi_program_ran(&run, &tasks);
}

/// MPI programs with a ps task on another host than the workers', launched across the
/// three hosts by the hostfile: the launchers supervise over TCP to rank 0's host (no
/// MPI of their own), so the ps task that waits for ever without finalising MPI is
/// stopped when the workers are done (C, then mpi4py with a worker that fails).
#[test]
fn mpi_programs_with_ps_tasks_across_hosts_end_with_their_workers() {
    let Some((script, _dir, program)) = mpi_program_on_hosts("multihost-mpi-ps") else {
        return;
    };
    let (m, hosts) = (mpiflow(), "hostfiles/netns-3hosts");
    let launch = |prog: &str| {
        let inner = format!(
            "mpirun $MPIFLOW_NETNS_MCA --hostfile {hosts} -np 3 --map-by node \
             {m} launch --hostfile {hosts} --map-by node --ps 1 -- {prog} --ps-joins"
        );
        on_hosts(&script, 240, &inner)
    };
    let run = launch(&program);
    assert_eq!(run.code, 0, "{run:?}");
    common::assert_mpi_program_ran(&run, &["ps:0", "worker:0", "worker:1"]);
    let Some(python) = common::python_with_mpi4py() else {
        return;
    };
    let run = launch(&format!("{python} {} --exit 3", common::mpi4py_program()));
    assert_eq!(run.code, 3, "{run:?}");
    let named = "mpiflow launch: worker:1 (rank 2) exited with status 3";
    assert_eq!(run.stderr.matches(named).count(), 1, "{run:?}");
}

/// Across hosts without the hostfile, `launch` must initialise MPI to learn the cluster,
/// so an MPI program cannot: it fails at once with one line that says what to do (rank
/// 0's), not in `MPI_Init` with the MPI library's pages of help.
#[test]
fn an_mpi_program_whose_rank_launch_had_to_take_is_one_line_error() {
    let Some((script, _dir, program)) = mpi_program_on_hosts("multihost-mpi-taken") else {
        return;
    };
    let inner = format!(
        "mpirun $MPIFLOW_NETNS_MCA --hostfile hostfiles/netns-3hosts -np 3 --map-by node \
         {} launch -- {program}",
        mpiflow()
    );
    let run = on_hosts(&script, 240, &inner);
    assert_ne!(run.code, 0, "{run:?}");
    let line = "mpiflow: error: the program initialises MPI itself, but `launch` had to \
                initialise it to learn the cluster";
    assert_eq!(run.stderr.matches(line).count(), 1, "{run:?}");
    assert!(!run.stderr.contains("orte_init"), "{run:?}");
    assert!(!run.stdout.contains("rank "), "{run:?}");
}
