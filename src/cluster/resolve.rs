//! Resolvers: where the cluster comes from, and which task this process is.
//!
//! - **MPI** (under `mpirun`/`mpiexec`/`srun --mpi=pmix`): rank, size and the host of every
//!   rank are gathered over MPI; each rank probes a free port on its own host; all ranks
//!   first check that they were started with the same mapping flags.
//! - **Slurm** (`srun` without MPI): see [`super::slurm`]; ports are `port_base + local
//!   task offset` (by default the job's own base, `ports::default_base`), and this
//!   task's port is checked to be free (when the node name is this host's).
//! - **Hostfile** (`--hostfile H -np N`, no MPI): a preview of what `mpirun` would do.
//! - **TF_CONFIG** and the **legacy flags**: the cluster as the user wrote it.
//!
//! `Source::Auto` picks, in order: hostfile if one is given, legacy flags if given, MPI if
//! an MPI launcher's variables are present, Slurm inside a Slurm step, TF_CONFIG if set,
//! and otherwise MPI as a single process.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;

use super::flags::{self, FlagsError};
use super::hostfile::{Hostfile, HostfileError, MapBy};
use super::mapping::{
    assign_roles, sequential_ports, Layout, MappingError, MappingOptions, RankInfo,
};
use super::ports::{self, PortError};
use super::slurm::{self, SlurmError, SlurmStep};
use super::spec::{Address, TaskId};
use super::tf_config::{TfConfig, TfConfigError};
use crate::named::Named;
use crate::transport::{Context, RankError};

/// Where the cluster comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Source {
    /// Pick from the environment (see the module docs).
    #[default]
    Auto,
    Mpi,
    Slurm,
    Hostfile,
    TfConfig,
    Flags,
}

impl crate::named::Named for Source {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (Source::Auto, "auto", "Pick from the environment"),
        (Source::Mpi, "mpi", "The ranks of the running MPI job"),
        (Source::Slurm, "slurm", "Slurm's variables (SLURM_*)"),
        (
            Source::Hostfile,
            "hostfile",
            "Preview what mpirun --hostfile would start",
        ),
        (Source::TfConfig, "tf-config", "TF_CONFIG of each process"),
        (
            Source::Flags,
            "flags",
            "The seeds' --ps_hosts --worker_hosts --job_name --task_index",
        ),
    ];
}

/// Environment variables that MPI launchers set in every process they start.
const MPI_LAUNCHER_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_SIZE", // OpenMPI mpirun
    "PMI_SIZE",             // MPICH hydra, srun --mpi=pmi2
    "PMIX_RANK",            // srun --mpi=pmix, PRRTE
    "MPI_LOCALNRANKS",      // MPICH hydra
];

/// True when an MPI launcher started this process (its variables are set).
pub fn under_mpi_launcher(env: &BTreeMap<String, String>) -> bool {
    MPI_LAUNCHER_VARS.iter().any(|v| env.contains_key(*v))
}

/// This process's rank when every rank of the job runs the same command line (OpenMPI's
/// `mpirun` with one app context: `OMPI_NUM_APP_CTX=1`), so an error found in the
/// arguments alone is every rank's; `None` otherwise (another launcher, or `mpirun A : B`).
pub fn rank_of_one_command(env: &BTreeMap<String, String>) -> Option<usize> {
    if env.get("OMPI_NUM_APP_CTX").map(String::as_str) != Some("1") {
        return None;
    }
    env.get("OMPI_COMM_WORLD_RANK")?.trim().parse().ok()
}

/// The rank an MPI launcher gave this process, read from its variables (for messages
/// written before MPI is initialised); a value that is no rank number is no hint (the
/// error about it names it).
pub fn launcher_rank_hint(env: &BTreeMap<String, String>) -> Option<String> {
    [
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "PMIX_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .find_map(|v| env.get(*v))
    .and_then(|r| r.trim().parse::<usize>().ok())
    .map(|r| r.to_string())
}

/// Everything a resolver needs besides the environment.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub source: Source,
    pub mapping: MappingOptions,
    /// First port to probe (MPI) or to number from (Slurm, previews); `None`: the job's
    /// own (`ports::default_base`).
    pub port_base: Option<u16>,
    pub hostfile: Option<PathBuf>,
    pub np: Option<usize>,
    pub map_by: MapBy,
    pub oversubscribe: bool,
    pub default_slots: usize,
    /// Legacy flags given to mpiflow itself (`--ps_hosts ...`).
    pub legacy_flags: Vec<String>,
    /// `rpc_layer` for the TF_CONFIG of clusters mpiflow builds (e.g. `grpc`).
    pub rpc_layer: Option<String>,
    /// The command's own flags that every rank must be given alike, as `(flag, value)`
    /// (`mpiflow train`'s mode, model, steps...): compared with the mapping flags.
    pub agreed: Vec<(String, String)>,
}

impl Request {
    /// The concrete source for this environment: the one place the cluster's source is
    /// chosen (the command line's and a program's [`crate::train::server::Server`]). A
    /// description given per process (the seeds' flags, then `TF_CONFIG`) comes before
    /// what the launcher implies (an MPI launcher's ranks, then Slurm's variables), as
    /// TensorFlow has it: a process told its task is that task (under an MPI launcher,
    /// matched to its rank). A hostfile asks for a preview.
    pub fn pick_source(&self, env: &BTreeMap<String, String>) -> Source {
        match self.source {
            Source::Auto if self.hostfile.is_some() => Source::Hostfile,
            Source::Auto if !self.legacy_flags.is_empty() => Source::Flags,
            Source::Auto if env.contains_key("TF_CONFIG") => Source::TfConfig,
            Source::Auto if under_mpi_launcher(env) => Source::Mpi,
            Source::Auto if slurm::detected(env) => Source::Slurm,
            Source::Auto => Source::Mpi,
            s => s,
        }
    }

    /// The first port: the one asked for, else the default for Slurm job `job`
    /// (`ports::default_base`).
    pub fn port_base_in(&self, job: Option<&str>) -> u16 {
        self.port_base.unwrap_or_else(|| ports::default_base(job))
    }

    /// A layout mpiflow built, with the requested `rpc_layer`.
    fn built(&self, layout: Layout) -> Layout {
        Layout {
            rpc_layer: self.rpc_layer.clone(),
            ..layout
        }
    }

    /// The flags that decide the mapping, then the command's own [`Request::agreed`], in a
    /// canonical order, so ranks can compare them.
    pub fn canonical_args(&self) -> Vec<(String, String)> {
        let m = &self.mapping;
        vec![
            ("--ps".into(), m.ps.to_string()),
            ("--chief".into(), m.chief.to_string()),
            ("--evaluator".into(), m.evaluator.to_string()),
            (
                "--placement".into(),
                format!("{:?}", m.placement).to_lowercase(),
            ),
            (
                "--stages".into(),
                m.stages.map_or_else(|| "none".into(), |s| s.to_string()),
            ),
            (
                "--port-base".into(),
                self.port_base
                    .map_or_else(|| "auto".into(), |p| p.to_string()),
            ),
            (
                "--rpc-layer".into(),
                self.rpc_layer.clone().unwrap_or_default(),
            ),
        ]
        .into_iter()
        .chain(self.agreed.iter().cloned())
        .collect()
    }
}

/// Errors from resolving the cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("{0}")]
    Rank(#[from] RankError),
    #[error("rank {rank} was started with {theirs} but rank 0 with {ours}: all ranks must get the same flags")]
    ArgsDiffer {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error("{0}")]
    Mapping(#[from] MappingError),
    #[error("Slurm job {job} has {ntasks} tasks, too few for {what}: ask for at least {need} (sbatch/srun -n {need})")]
    SmallAllocation {
        job: String,
        ntasks: usize,
        what: String,
        need: usize,
    },
    #[error("{0}")]
    Hostfile(#[from] HostfileError),
    #[error("{0}")]
    Slurm(#[from] SlurmError),
    #[error("{0}")]
    TfConfig(#[from] TfConfigError),
    #[error("{0}")]
    Flags(#[from] FlagsError),
    #[error("{0}")]
    Port(#[from] PortError),
    #[error("{0}")]
    Usage(String),
}

/// A resolved cluster and this process's place in it.
#[derive(Debug)]
pub struct Resolved {
    pub source: Source,
    pub layout: Layout,
    /// Index into `layout.ranks` of this process; `None` for a hostfile preview.
    pub me: Option<usize>,
    /// This process's task when its cluster leaves it out: an evaluator, which TensorFlow
    /// keeps outside the `ClusterSpec` ([`bind_ranks`] gives it its rank).
    pub outside: Option<TaskId>,
    /// The world size (`None` for TF_CONFIG and flags, which know no ranks).
    pub size: Option<usize>,
    /// The probed port, held until the caller is ready to hand it over.
    pub port_guard: Option<TcpListener>,
}

fn render_args(args: &[(String, String)]) -> String {
    args.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Collective: stops every rank if any rank's mapping flags differ from rank 0's.
/// Cheap in the common case (one 8-byte allgather); the full flags only on mismatch.
fn check_same_args(ctx: &Context, args: &[(String, String)]) -> Result<(), ResolveError> {
    let text = render_args(args);
    let hash = crate::hash::fnv1a(text.as_bytes());
    let hashes = ctx.all_gather_bytes(&hash.to_le_bytes());
    if hashes.iter().all(|h| *h == hashes[0]) {
        return Ok(());
    }
    let all = ctx.all_gather_strings(&text);
    let rank = (1..all.len())
        .find(|r| all[*r] != all[0])
        .expect("hashes differ");
    let split = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
    let (ours, theirs) = (split(&all[0]), split(&all[rank]));
    let (o, t) = ours
        .iter()
        .zip(&theirs)
        .find(|(o, t)| o != t)
        .map(|(o, t)| (o.clone(), t.clone()))
        .unwrap_or_else(|| (all[0].clone(), all[rank].clone()));
    Err(ResolveError::ArgsDiffer {
        rank,
        theirs: t,
        ours: o,
    })
}

/// The roles of `hosts`. Inside a Slurm job, too few tasks for the requested jobs is the
/// allocation's fault: the error says which job and how many tasks to ask for.
fn roles(
    hosts: &[String],
    req: &Request,
    slurm_job: Option<String>,
) -> Result<Vec<TaskId>, ResolveError> {
    assign_roles(hosts, &req.mapping).map_err(|e| match (slurm_job, e) {
        (Some(job), MappingError::TooManyPs { ps, ranks }) => ResolveError::SmallAllocation {
            job,
            ntasks: ranks,
            what: format!("--ps {ps}"),
            need: ps + 1,
        },
        (
            Some(job),
            MappingError::TooFewRanks {
                ranks,
                ps,
                extra,
                need,
            },
        ) => ResolveError::SmallAllocation {
            job,
            ntasks: ranks,
            what: format!("--ps {ps}{extra}"),
            need,
        },
        (_, e) => e.into(),
    })
}

/// The MPI resolver (collective over the world communicator).
pub fn resolve_mpi(ctx: &Context, req: &Request) -> Result<Resolved, ResolveError> {
    check_same_args(ctx, &req.canonical_args())?;
    let host = ctx.host();
    let hosts = ctx.all_gather_strings(&host);
    // Every rank has the same hosts and flags, so a mapping error is the same everywhere.
    let job = std::env::var("SLURM_JOB_ID").ok();
    let base = req.port_base_in(job.as_deref());
    let tasks = roles(&hosts, req, job)?;
    let rank = ctx.rank();
    let locals = super::mapping::local_ranks(&hosts);
    let local_count = hosts.iter().filter(|h| **h == host).count();
    let probed = ctx.agree(ports::probe(&host, base, locals[rank], local_count))?;
    let (guard, port) = probed;
    let ports: Vec<u16> = ctx
        .all_gather_bytes(&port.to_le_bytes())
        .into_iter()
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let layout = req.built(Layout::from_ranks(&hosts, &ports, tasks)?);
    Ok(Resolved {
        source: Source::Mpi,
        layout,
        me: Some(rank),
        outside: None,
        size: Some(ctx.size()),
        port_guard: Some(guard),
    })
}

/// The MPI job's cluster without initialising MPI, where its launcher's variables tell it
/// ([`super::launched`]: every rank on this host under `mpirun` or `mpiexec`; Slurm's step
/// under `srun`), so that a program started as the rank can still initialise MPI. Ports
/// are numbered from the base, not probed (this rank's is checked free). `None`: only MPI
/// can tell (ranks on several hosts under `mpirun`), or no launcher started this process.
pub fn resolve_launched(
    req: &Request,
    env: &BTreeMap<String, String>,
) -> Result<Option<Resolved>, ResolveError> {
    use super::launched::{from_env, Launched, OneHost};
    let OneHost { rank, size } = match from_env(env) {
        Launched::OneHost(one) => one,
        Launched::Unknown if slurm::detected(env) => {
            return resolve_offline(req, Source::Slurm, env).map(Some)
        }
        Launched::Hosts { .. } | Launched::Unknown => return Ok(None),
    };
    let host = env.get("MPIFLOW_HOST").cloned().or_else(hostname);
    let hosts = vec![host.unwrap_or_else(|| "localhost".into()); size];
    let job = env.get("SLURM_JOB_ID").cloned();
    let base = req.port_base_in(job.as_deref());
    let tasks = roles(&hosts, req, job)?;
    let ports = sequential_ports(&hosts, base)?;
    let layout = req.built(Layout::from_ranks(&hosts, &ports, tasks)?);
    let me = &layout.ranks[rank];
    let guard = own_port(me.address.port, &me.task, &me.host)?;
    Ok(Some(Resolved {
        source: Source::Mpi,
        layout,
        me: Some(rank),
        outside: None,
        size: Some(size),
        port_guard: Some(guard),
    }))
}

/// The cluster of a hostfile (`req.hostfile`, mapped as the MPI launcher maps it: give
/// both the same hostfile and mapping options) for the rank the launcher's variables name
/// ([`super::launched::rank_and_size`]), without MPI: how `launch` learns a job across
/// hosts under `mpirun`. `None` outside an MPI launcher; an error if the hostfile places
/// this rank on another host than the one it runs on.
pub fn resolve_hostfile_rank(
    req: &Request,
    env: &BTreeMap<String, String>,
) -> Result<Option<Resolved>, ResolveError> {
    let Some((rank, size)) = super::launched::rank_and_size(env) else {
        return Ok(None);
    };
    let req = Request {
        np: Some(req.np.unwrap_or(size)),
        ..req.clone()
    };
    if req.np != Some(size) {
        return Err(ResolveError::Usage(format!(
            "rank {rank}: -np {} but the job has {size} ranks",
            req.np.unwrap_or(0)
        )));
    }
    let mut resolved = resolve_offline(&req, Source::Hostfile, env)?;
    let me = &resolved.layout.ranks[rank];
    let host = env.get("MPIFLOW_HOST").cloned().or_else(hostname);
    if !is_this_host(&me.host) && host.as_deref() != Some(me.host.as_str()) {
        return Err(ResolveError::Usage(format!(
            "rank {rank}: the hostfile places it on {} but it runs on {} (give mpirun the same --hostfile and mapping)",
            me.host,
            host.unwrap_or_else(|| "an unknown host".into())
        )));
    }
    resolved.port_guard = Some(own_port(me.address.port, &me.task, &me.host)?);
    resolved.me = Some(rank);
    Ok(Some(resolved))
}

/// The resolvers that need no MPI: Slurm, hostfile preview, TF_CONFIG, legacy flags.
pub fn resolve_offline(
    req: &Request,
    source: Source,
    env: &BTreeMap<String, String>,
) -> Result<Resolved, ResolveError> {
    match source {
        Source::Hostfile => {
            let path = req
                .hostfile
                .as_ref()
                .ok_or_else(|| ResolveError::Usage("--from hostfile needs --hostfile H".into()))?;
            let np = req.np.ok_or_else(|| {
                ResolveError::Usage("--hostfile needs -np N (the number of ranks)".into())
            })?;
            let hf = Hostfile::read(path, req.default_slots)?;
            let hosts = hf.map(np, req.map_by, req.oversubscribe)?;
            let tasks = assign_roles(&hosts, &req.mapping)?;
            let base = req.port_base_in(env.get("SLURM_JOB_ID").map(String::as_str));
            let ports = sequential_ports(&hosts, base)?;
            Ok(Resolved {
                source,
                layout: req.built(Layout::from_ranks(&hosts, &ports, tasks)?),
                me: None,
                outside: None,
                size: Some(np),
                port_guard: None,
            })
        }
        Source::Slurm => {
            let step = SlurmStep::from_env(env)?;
            let job = env.get("SLURM_JOB_ID");
            let base = req.port_base_in(job.map(String::as_str));
            let tasks = roles(&step.hosts, req, job.cloned())?;
            let ports = sequential_ports(&step.hosts, base)?;
            let layout = req.built(Layout::from_ranks(&step.hosts, &ports, tasks)?);
            let me = &layout.ranks[step.rank];
            // A node whose Slurm name is not this machine's host name (a fake node of
            // Slurm's multiple-slurmd mode, or NodeName differing from NodeHostname) is not
            // the host the port would be checked on: there the check is skipped.
            let guard = if is_this_host(&me.host) {
                Some(own_port(me.address.port, &me.task, &me.host)?)
            } else {
                None
            };
            Ok(Resolved {
                source,
                me: Some(step.rank),
                outside: None,
                size: Some(step.hosts.len()),
                layout,
                port_guard: guard,
            })
        }
        Source::TfConfig | Source::Flags => {
            let config = if source == Source::Flags {
                flags::parse(&req.legacy_flags)?
            } else {
                let text = env
                    .get("TF_CONFIG")
                    .ok_or(ResolveError::TfConfig(TfConfigError::NotSet))?;
                TfConfig::parse(text)?
            };
            let layout = Layout::from_tf_config(&config);
            let me = layout.ranks.iter().position(|r| r.task == config.task);
            // An evaluator outside the cluster, as TensorFlow allows (the parser admits
            // no other task outside it).
            let outside = me.is_none().then(|| config.task.clone());
            let guard = match me.map(|i| &layout.ranks[i]) {
                Some(r) if is_this_host(&r.host) => {
                    Some(own_port(r.address.port, &r.task, &r.host)?)
                }
                _ => None,
            };
            Ok(Resolved {
                source,
                layout,
                me,
                outside,
                size: None,
                port_guard: guard,
            })
        }
        Source::Mpi | Source::Auto => Err(ResolveError::Usage(format!(
            "source {} needs MPI",
            source.name()
        ))),
    }
}

/// A cluster described per process (`source`: TF_CONFIG or the seeds' flags) matched to
/// the ranks of `ctx`: each process's task to its rank ([`bind_ranks`]). Every error is
/// the same on every rank.
pub fn resolve_bound(
    ctx: &Context,
    req: &Request,
    source: Source,
    env: &BTreeMap<String, String>,
) -> Result<Layout, ResolveError> {
    let offline = ctx.agree(resolve_offline(req, source, env))?;
    bind_ranks(ctx, offline)
}

/// The place of a rank whose task is outside the cluster (an evaluator, no server of the
/// cluster: no port), on `host`.
fn outside_the_cluster(task: &str, host: &str) -> Result<RankInfo, ResolveError> {
    // As every rank's task was sent: `job:index`.
    let id = task
        .split_once(':')
        .and_then(|(job, i)| Some(TaskId::new(job, i.parse().ok()?)))
        .ok_or_else(|| ResolveError::Usage(format!("task {task:?} is not job:index")))?;
    Ok(RankInfo {
        rank: None,
        host: host.to_string(),
        local_rank: None,
        task: id,
        address: Address {
            host: host.to_string(),
            port: 0,
        },
    })
}

fn own_port(port: u16, task: &TaskId, host: &str) -> Result<TcpListener, PortError> {
    ports::try_bind(port).ok_or_else(|| PortError::InUse {
        port,
        task: task.to_string(),
        host: host.into(),
    })
}

/// True if `host` names this machine (its hostname, or a loopback name).
fn is_this_host(host: &str) -> bool {
    if host == "localhost" || host.starts_with("127.") || host == "::1" {
        return true;
    }
    hostname().is_some_and(|h| h == host || h.split('.').next() == Some(host))
}

/// This machine's host name (`gethostname`: [`crate::transport::comm::host_name`]).
pub fn hostname() -> Option<String> {
    crate::transport::comm::host_name()
}

/// Collective: gives the tasks of a cluster that came from TF_CONFIG or flags (which know
/// no ranks) the MPI ranks whose processes took them. Every rank must have the same
/// cluster, and the world must hold each task exactly once; otherwise every rank stops
/// with the same error naming the rank or task at fault.
pub fn bind_ranks(ctx: &Context, resolved: Resolved) -> Result<Layout, ResolveError> {
    let layout = resolved.layout;
    let mine = match (resolved.me, &resolved.outside) {
        (Some(i), _) => Ok(layout.ranks[i].task.to_string()),
        (None, Some(task)) => Ok(task.to_string()),
        (None, None) => Err(ResolveError::Usage(
            "this process's task is not in its cluster".into(),
        )),
    };
    let mine = ctx.agree(mine)?;
    let spec = format!("{:?}", layout.spec);
    let hashes = ctx.all_gather_bytes(&crate::hash::fnv1a(spec.as_bytes()).to_le_bytes());
    if let Some(r) = hashes.iter().position(|h| *h != hashes[0]) {
        return Err(ResolveError::Usage(format!(
            "rank {r} was given another cluster than rank 0 (TF_CONFIG or --ps_hosts/--worker_hosts differ)"
        )));
    }
    let tasks = ctx.all_gather_strings(&mine);
    let inside = |task: &str| layout.ranks.iter().find(|r| r.task.to_string() == task);
    // Tasks outside the cluster (evaluators) are placed by their hosts: every rank learns
    // them the same way (a collective only when there are some, on every rank alike).
    let hosts = match tasks.iter().all(|t| inside(t).is_some()) {
        true => Vec::new(),
        false => ctx.all_gather_strings(&ctx.host()),
    };
    let mut ranks = Vec::with_capacity(tasks.len());
    for (rank, task) in tasks.iter().enumerate() {
        if let Some(first) = tasks[..rank].iter().position(|t| t == task) {
            return Err(ResolveError::Usage(format!(
                "ranks {first} and {rank} both run task {task}"
            )));
        }
        let mut info = match inside(task) {
            Some(info) => info.clone(),
            None => outside_the_cluster(task, &hosts[rank])?,
        };
        info.rank = Some(rank);
        ranks.push(info);
    }
    if let Some(missing) = layout
        .ranks
        .iter()
        .find(|r| !tasks.contains(&r.task.to_string()))
    {
        return Err(ResolveError::Usage(format!(
            "task {} of the cluster has no process: {} tasks, {} MPI ranks",
            missing.task,
            layout.ranks.len(),
            tasks.len()
        )));
    }
    Ok(Layout { ranks, ..layout })
}

#[cfg(test)]
mod tests;
