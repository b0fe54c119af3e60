//! Which of Open MPI's components carry a job (`--rdma-stack`), decided before `MPI_Init`.
//!
//! Open MPI reads its choice of point-to-point layer (`pml`) and one-sided layer (`osc`)
//! from `OMPI_MCA_*` variables at initialisation, so the choice is made from what can be
//! known before: the library's version string, the machine's RDMA devices, the
//! components installed, and what the user set.
//!
//! - `ompi`: Open MPI's own layers: `pml ob1` and `osc sm,pt2pt` (shared memory within a
//!   node, emulation over point-to-point messages between nodes).
//! - `ucx`: `pml ucx` and `osc ucx`. Without an RDMA device, UCX is only selected when told
//!   to use any transport (`pml_ucx_tls`/`pml_ucx_devices`, which the osc shares): mpiflow
//!   says so in its line, and never sets those two where an RDMA device exists.
//! - `auto`: with an RDMA device, the library's own choice (UCX on InfiniBand/RoCE);
//!   without one, `osc sm,pt2pt` (the library's default `osc rdma` crashes in
//!   `MPI_Compare_and_swap` over shared memory and cannot make windows over TCP), because
//!   UCX without RDMA is slower for the one-sided ps: it emulates atomics on the target,
//!   which must poll (`benches/results/2026-11-24-ucx.md`).
//!
//! A variable the user set is kept: `auto` follows it, an explicit stack it contradicts is
//! an error.

use crate::named::Named;

/// `--rdma-stack`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RdmaStack {
    /// The default.
    #[default]
    Auto,
    Ucx,
    Ompi,
}

impl crate::named::Named for RdmaStack {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            RdmaStack::Auto,
            "auto",
            "the library's choice with an RDMA device; osc sm,pt2pt without",
        ),
        (
            RdmaStack::Ucx,
            "ucx",
            "pml ucx and osc ucx (any transport without RDMA)",
        ),
        (RdmaStack::Ompi, "ompi", "pml ob1 and osc sm,pt2pt"),
    ];
}

/// What is known before `MPI_Init`.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Open MPI's major version, `None` for another library.
    pub open_mpi: Option<u32>,
    /// RDMA devices (`/sys/class/infiniband`).
    pub rdma_devices: Vec<String>,
    /// Open MPI's component files (`mca_pml_ucx.so`, ...) and their directory, when found.
    pub components: Option<(std::path::PathBuf, Vec<String>)>,
}

impl Facts {
    /// This process's facts: the library linked, this machine's devices and components.
    pub fn detect() -> Facts {
        Facts {
            open_mpi: super::threads::open_mpi_major(&super::threads::library()),
            rdma_devices: super::rma::rdma_devices(),
            components: components(),
        }
    }
}

/// Variables to set before `MPI_Init`, and the line that says so (`None` when nothing is
/// set, or for `auto`, whose choice the one-sided code reports).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    pub vars: Vec<(&'static str, String)>,
    pub note: Option<String>,
}

/// Errors from [`settings`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StackError {
    #[error("--rdma-stack {} chooses Open MPI's components, but this MPI is not Open MPI", .0.name())]
    NotOpenMpi(RdmaStack),
    #[error("--rdma-stack ucx: this Open MPI has no {missing} (not in {dir})")]
    NoUcx { missing: String, dir: String },
    #[error("--rdma-stack {}: {var}={value} says otherwise (unset it, or drop the flag)", .stack.name())]
    Contradicted {
        stack: RdmaStack,
        var: &'static str,
        value: String,
    },
}

const PML: &str = "OMPI_MCA_pml";
const OSC: &str = "OMPI_MCA_osc";
const UCX_TLS: &str = "OMPI_MCA_pml_ucx_tls";
const UCX_DEVICES: &str = "OMPI_MCA_pml_ucx_devices";

/// The variables `stack` sets on a machine with `facts`, given the environment `env`.
pub fn settings(
    stack: RdmaStack,
    facts: &Facts,
    env: &std::collections::BTreeMap<String, String>,
) -> Result<Settings, StackError> {
    if facts.open_mpi.is_none() {
        return match stack {
            RdmaStack::Auto => Ok(Settings::default()),
            s => Err(StackError::NotOpenMpi(s)),
        };
    }
    let rdma = !facts.rdma_devices.is_empty();
    let wanted: Vec<(&'static str, String)> = match stack {
        RdmaStack::Auto if rdma => return Ok(Settings::default()),
        // The user's choice of one-sided components stands.
        RdmaStack::Auto if env.contains_key(OSC) => return Ok(Settings::default()),
        RdmaStack::Auto => vec![(OSC, super::rma::OSC_WITHOUT_RDMA.into())],
        RdmaStack::Ompi => vec![
            (PML, "ob1".into()),
            (OSC, super::rma::OSC_WITHOUT_RDMA.into()),
        ],
        RdmaStack::Ucx => {
            if let Some((dir, files)) = &facts.components {
                for c in ["mca_pml_ucx.so", "mca_osc_ucx.so"] {
                    if !files.iter().any(|f| f == c) {
                        return Err(StackError::NoUcx {
                            missing: c.into(),
                            dir: dir.display().to_string(),
                        });
                    }
                }
            }
            let mut v = vec![(PML, "ucx".to_string()), (OSC, "ucx".to_string())];
            if !rdma {
                v.push((UCX_TLS, "any".into()));
                v.push((UCX_DEVICES, "any".into()));
            }
            v
        }
    };
    let mut vars = Vec::new();
    for (var, value) in wanted {
        match env.get(var) {
            Some(v) if *v == value => {}
            Some(v) => {
                return Err(StackError::Contradicted {
                    stack,
                    var,
                    value: v.clone(),
                })
            }
            None => vars.push((var, value)),
        }
    }
    let note = match stack {
        // Said once: by the process that sets the variables, not again after.
        _ if vars.is_empty() => None,
        // The one-sided ps and benchmarks say which osc they run on.
        RdmaStack::Auto => None,
        RdmaStack::Ompi => Some("# mpi: --rdma-stack ompi: pml ob1, osc sm,pt2pt".to_string()),
        RdmaStack::Ucx if rdma => Some(format!(
            "# mpi: --rdma-stack ucx: pml ucx, osc ucx on RDMA devices {}",
            facts.rdma_devices.join(",")
        )),
        RdmaStack::Ucx => Some(
            "# mpi: --rdma-stack ucx: pml ucx, osc ucx, UCX on any transport (no RDMA device: shared memory and TCP, one-sided atomics emulated on the target)"
                .to_string(),
        ),
    };
    Ok(Settings { vars, note })
}

/// One port of an RDMA device, as `/sys/class/infiniband` describes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RdmaPort {
    pub device: String,
    pub port: u32,
    /// `ACTIVE`, `DOWN`, ... (the word after the number in `ports/N/state`).
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
}

impl std::fmt::Display for RdmaPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (d, p, s, l) = (&self.device, self.port, &self.state, &self.link_layer);
        write!(f, "{d}:{p} {s} {l}")
    }
}

/// Every port of every RDMA device under `root` (`/sys/class/infiniband` on a real
/// machine), sorted; empty without devices.
pub fn rdma_ports(root: &std::path::Path) -> Vec<RdmaPort> {
    let read = |p: std::path::PathBuf| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    let names = |d: &std::path::Path| -> Vec<String> {
        std::fs::read_dir(d)
            .map(|r| {
                r.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                    .collect()
            })
            .unwrap_or_default()
    };
    for device in names(root) {
        let ports = root.join(&device).join("ports");
        for port in names(&ports).iter().filter_map(|p| p.parse::<u32>().ok()) {
            let dir = ports.join(port.to_string());
            let state = read(dir.join("state"));
            out.push(RdmaPort {
                device: device.clone(),
                port,
                // "4: ACTIVE" -> "ACTIVE"
                state: state.rsplit(' ').next().unwrap_or_default().to_string(),
                link_layer: read(dir.join("link_layer")),
            });
        }
    }
    out.sort_by(|a, b| (&a.device, a.port).cmp(&(&b.device, b.port)));
    out
}

/// The transports UCX offers on this machine (`ucx_info -d`, Debian's `ucx-utils`), in
/// its order without repeats; `None` when `ucx_info` cannot be run.
pub fn ucx_transports() -> Option<Vec<String>> {
    let out = std::process::Command::new("ucx_info")
        .arg("-d")
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(parse_ucx_transports(&String::from_utf8_lossy(&out.stdout)))
}

/// The `Transport:` names of `ucx_info -d`'s output, first appearance order.
fn parse_ucx_transports(text: &str) -> Vec<String> {
    let mut seen = Vec::new();
    for l in text.lines() {
        let Some((_, t)) = l.split_once("Transport:") else {
            continue;
        };
        let t = t.trim().to_string();
        if !t.is_empty() && !seen.contains(&t) {
            seen.push(t);
        }
    }
    seen
}

/// The point-to-point layer (`pml`) Open MPI selected for this process (`"ob1"`, `"ucx"`,
/// ...), after `MPI_Init`: the one component file `mca_pml_*.so` still mapped (Open MPI
/// unloads the ones it did not select), else `OMPI_MCA_pml` when it names one (a static
/// build); `None` when neither says. Read once per process (every communicator asks; the
/// choice is fixed at `MPI_Init`).
pub fn selected_pml() -> Option<&'static str> {
    static PML: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PML.get_or_init(|| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let from_env = std::env::var("OMPI_MCA_pml").ok();
        selected_pml_in(&maps, from_env.as_deref())
    })
    .as_deref()
}

fn selected_pml_in(maps: &str, from_env: Option<&str>) -> Option<String> {
    let mut mapped: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter_map(|p| {
            p.rsplit('/')
                .next()?
                .strip_prefix("mca_pml_")?
                .strip_suffix(".so")
        })
        .collect();
    mapped.dedup();
    match (mapped.as_slice(), from_env) {
        ([one], _) => Some(one.to_string()),
        ([], Some(v)) if !v.is_empty() && !v.contains([',', '^']) => Some(v.to_string()),
        _ => None,
    }
}

/// Open MPI's component directory and its files, beside the `libmpi` this process mapped:
/// `LIBDIR/openmpi` upstream; Debian keeps `libmpi` in the multiarch directory and the
/// components in `openmpi/lib/openmpi3` under it.
fn components() -> Option<(std::path::PathBuf, Vec<String>)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let lib = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libmpi.so"))?;
    let libdir = std::fs::canonicalize(lib).ok()?.parent()?.to_path_buf();
    let subs = [
        "openmpi",
        "openmpi3",
        "openmpi/lib/openmpi3",
        "openmpi/lib/openmpi",
    ];
    subs.iter().find_map(|sub| {
        let dir = libdir.join(sub);
        let files = std::fs::read_dir(&dir)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|f| f.starts_with("mca_"))
            .collect::<Vec<_>>();
        (!files.is_empty()).then_some((dir, files))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env;

    #[test]
    fn the_selected_pml_is_the_component_still_mapped_else_the_variable() {
        let line = |f: &str| {
            format!("7f1c2000-7f1c3000 r-xp 00000000 fe:01 123 /usr/lib/openmpi3/mca_pml_{f}.so\n")
        };
        let ucx = line("ucx") + &line("ucx");
        assert_eq!(selected_pml_in(&ucx, None).as_deref(), Some("ucx"));
        assert_eq!(
            selected_pml_in(&line("ob1"), Some("ucx")).as_deref(),
            Some("ob1")
        );
        assert_eq!(selected_pml_in("", Some("ucx")).as_deref(), Some("ucx"));
        assert_eq!(selected_pml_in("", Some("ucx,ob1")), None);
        assert_eq!(selected_pml_in("", Some("^ucx")), None);
        assert_eq!(selected_pml_in("", None), None);
        assert_eq!(selected_pml_in(&(line("ob1") + &line("ucx")), None), None);
    }

    fn facts(rdma: bool, ucx: bool) -> Facts {
        let mut files = vec!["mca_pml_ob1.so".to_string(), "mca_osc_pt2pt.so".into()];
        if ucx {
            files.extend(["mca_pml_ucx.so".into(), "mca_osc_ucx.so".into()]);
        }
        Facts {
            open_mpi: Some(4),
            rdma_devices: if rdma { vec!["mlx5_0".into()] } else { vec![] },
            components: Some(("/usr/lib/openmpi".into(), files)),
        }
    }

    fn vars(s: &Settings) -> Vec<String> {
        s.vars.iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    #[test]
    fn auto_keeps_the_librarys_choice_on_rdma_and_avoids_osc_rdma_without() {
        let none = env(&[]);
        let s = settings(RdmaStack::Auto, &facts(true, true), &none).unwrap();
        assert_eq!(s, Settings::default());
        let s = settings(RdmaStack::Auto, &facts(false, true), &none).unwrap();
        assert_eq!(vars(&s), ["OMPI_MCA_osc=sm,pt2pt"]);
        assert_eq!(s.note, None);
        // The user's osc stands.
        let mine = env(&[("OMPI_MCA_osc", "ucx")]);
        let s = settings(RdmaStack::Auto, &facts(false, true), &mine).unwrap();
        assert_eq!(s, Settings::default());
        // Another MPI: nothing.
        let mpich = Facts {
            open_mpi: None,
            ..facts(false, true)
        };
        assert_eq!(
            settings(RdmaStack::Auto, &mpich, &none).unwrap(),
            Settings::default()
        );
        assert_eq!(
            settings(RdmaStack::Ucx, &mpich, &none).unwrap_err(),
            StackError::NotOpenMpi(RdmaStack::Ucx)
        );
    }

    #[test]
    fn ucx_opens_any_transport_only_without_rdma_devices() {
        let none = env(&[]);
        let s = settings(RdmaStack::Ucx, &facts(false, true), &none).unwrap();
        assert_eq!(
            vars(&s),
            [
                "OMPI_MCA_pml=ucx",
                "OMPI_MCA_osc=ucx",
                "OMPI_MCA_pml_ucx_tls=any",
                "OMPI_MCA_pml_ucx_devices=any"
            ]
        );
        assert!(s.note.unwrap().contains("no RDMA device"));
        let s = settings(RdmaStack::Ucx, &facts(true, true), &none).unwrap();
        assert_eq!(vars(&s), ["OMPI_MCA_pml=ucx", "OMPI_MCA_osc=ucx"]);
        assert!(s.note.unwrap().contains("mlx5_0"));
    }

    #[test]
    fn a_missing_component_or_a_contradicting_variable_is_one_line() {
        let none = env(&[]);
        let e = settings(RdmaStack::Ucx, &facts(false, false), &none).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--rdma-stack ucx: this Open MPI has no mca_pml_ucx.so (not in /usr/lib/openmpi)"
        );
        let ob1 = env(&[("OMPI_MCA_pml", "ob1")]);
        let e = settings(RdmaStack::Ucx, &facts(false, true), &ob1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--rdma-stack ucx: OMPI_MCA_pml=ob1 says otherwise (unset it, or drop the flag)"
        );
        // The same value is no contradiction, and is not set twice.
        let ucx = env(&[("OMPI_MCA_pml", "ucx")]);
        let s = settings(RdmaStack::Ucx, &facts(true, true), &ucx).unwrap();
        assert_eq!(vars(&s), ["OMPI_MCA_osc=ucx"]);
        let s = settings(RdmaStack::Ompi, &facts(false, true), &none).unwrap();
        assert_eq!(vars(&s), ["OMPI_MCA_pml=ob1", "OMPI_MCA_osc=sm,pt2pt"]);
    }

    #[test]
    fn rdma_ports_and_ucx_transports_are_read_as_the_system_writes_them() {
        let root = std::env::temp_dir().join(format!("mpiflow-ib-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (dev, port, state, link) in [
            ("mlx5_1", 1, "1: DOWN", "Ethernet"),
            ("mlx5_0", 1, "4: ACTIVE", "InfiniBand"),
        ] {
            let d = root.join(dev).join("ports").join(port.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("state"), format!("{state}\n")).unwrap();
            std::fs::write(d.join("link_layer"), format!("{link}\n")).unwrap();
        }
        let ports: Vec<String> = rdma_ports(&root).iter().map(|p| p.to_string()).collect();
        assert_eq!(
            ports,
            ["mlx5_0:1 ACTIVE InfiniBand", "mlx5_1:1 DOWN Ethernet"]
        );
        std::fs::remove_dir_all(&root).unwrap();
        assert!(rdma_ports(&root).is_empty());
        let text = "#      Transport: self\n#         Device: memory0\n#      Transport: tcp\n\
                    #         Device: lo\n#      Transport: tcp\n#         Device: eth0\n\
                    #      Transport: rc_mlx5\n";
        assert_eq!(parse_ucx_transports(text), ["self", "tcp", "rc_mlx5"]);
    }

    #[test]
    fn this_machines_open_mpi_components_are_found() {
        // Debian's OpenMPI here is built with UCX (platform notes).
        let f = Facts::detect();
        if f.open_mpi.is_some() {
            let (_, files) = f.components.expect("component directory");
            assert!(files.iter().any(|c| c == "mca_pml_ob1.so"), "{files:?}");
        }
    }
}
