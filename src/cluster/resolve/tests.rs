use super::*;
use crate::test_support::env;

/// `launch --hostfile` under mpirun: the hostfile's cluster, the rank from mpirun's
/// variables; a rank the hostfile puts elsewhere, or another job size, is refused.
#[test]
fn a_hostfile_and_the_launchers_rank_give_this_ranks_task() {
    let dir = std::env::temp_dir().join(format!("mpiflow-hostfile-rank-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (here, elsewhere) = (dir.join("here"), dir.join("elsewhere"));
    std::fs::write(&here, "localhost slots=4\n").unwrap();
    std::fs::write(&elsewhere, "localhost slots=1\nno-such-host-here slots=3\n").unwrap();
    let req = |path: &std::path::Path| Request {
        hostfile: Some(path.to_path_buf()),
        // Ports of this test's own (this rank's is bound to check it is free), above
        // Linux's ephemeral range (32768-60999) so no outgoing connection holds one.
        port_base: Some(61_000 + (std::process::id() % 4_000) as u16),
        mapping: MappingOptions {
            ps: 1,
            ..MappingOptions::default()
        },
        ..Request::default()
    };
    let mpirun = |rank: &str| {
        env(&[
            ("OMPI_COMM_WORLD_RANK", rank),
            ("OMPI_COMM_WORLD_SIZE", "3"),
        ])
    };
    assert!(resolve_hostfile_rank(&req(&here), &env(&[]))
        .unwrap()
        .is_none());
    let r = resolve_hostfile_rank(&req(&here), &mpirun("2"))
        .unwrap()
        .unwrap();
    assert_eq!(r.me, Some(2));
    assert_eq!(r.layout.ranks.len(), 3);
    assert_eq!(r.layout.ranks[2].task, TaskId::new("worker", 1));
    let e = resolve_hostfile_rank(&req(&elsewhere), &mpirun("1")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("rank 1: the hostfile places it on no-such-host-here"),
        "{e}"
    );
    let four = Request {
        np: Some(4),
        ..req(&here)
    };
    let e = resolve_hostfile_rank(&four, &mpirun("0")).unwrap_err();
    assert_eq!(e.to_string(), "rank 0: -np 4 but the job has 3 ranks");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn auto_source_order() {
    let req = Request::default();
    assert_eq!(req.pick_source(&env(&[])), Source::Mpi);
    assert_eq!(
        req.pick_source(&env(&[("TF_CONFIG", "{}")])),
        Source::TfConfig
    );
    let mut slurm = env(&[("SLURM_PROCID", "0"), ("SLURM_JOB_ID", "1")]);
    assert_eq!(req.pick_source(&slurm), Source::Slurm);
    let mut under_mpirun = slurm.clone();
    under_mpirun.insert("OMPI_COMM_WORLD_SIZE".into(), "4".into());
    assert_eq!(req.pick_source(&under_mpirun), Source::Mpi);
    // A process's own description comes before the launcher's.
    slurm.insert("TF_CONFIG".into(), "{}".into());
    assert_eq!(req.pick_source(&slurm), Source::TfConfig);
    under_mpirun.insert("TF_CONFIG".into(), "{}".into());
    assert_eq!(req.pick_source(&under_mpirun), Source::TfConfig);
    let flags = Request {
        legacy_flags: vec!["--job_name=ps".into()],
        ..Request::default()
    };
    assert_eq!(flags.pick_source(&under_mpirun), Source::Flags);
    let preview = Request {
        hostfile: Some("h".into()),
        ..Request::default()
    };
    assert_eq!(preview.pick_source(&under_mpirun), Source::Hostfile);
}

#[test]
fn slurm_resolver_builds_the_cluster() {
    let req = Request {
        mapping: MappingOptions {
            ps: 2,
            placement: super::super::mapping::Placement::Spread,
            ..Default::default()
        },
        port_base: Some(30500),
        ..Request::default()
    };
    let e = env(&[
        ("SLURM_JOB_ID", "1"),
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_JOB_NODELIST", "node[1-2]"),
        ("SLURM_TASKS_PER_NODE", "2(x2)"),
    ]);
    let r = resolve_offline(&req, Source::Slurm, &e).unwrap();
    assert_eq!(r.me, Some(2));
    assert_eq!(
        r.layout.spec.to_string(),
        r#"{"ps":["node1:30500","node2:30500"],"worker":["node1:30501","node2:30501"]}"#
    );
    // node2 is not this machine: no port to check or hold here.
    assert!(r.port_guard.is_none());
    // Without --port-base, the job's own ports (job 1: from 10064).
    let auto = Request {
        port_base: None,
        ..req.clone()
    };
    let r = resolve_offline(&auto, Source::Slurm, &e).unwrap();
    assert_eq!(
        r.layout.spec.to_string(),
        r#"{"ps":["node1:10064","node2:10064"],"worker":["node1:10065","node2:10065"]}"#
    );
    // On this machine's own node, the port this task needs is held: a second resolve
    // of the same task fails.
    let me = hostname().unwrap();
    let mut here = e.clone();
    here.insert("SLURM_JOB_NODELIST".into(), format!("{me},other"));
    here.insert("SLURM_PROCID".into(), "0".into());
    let held = resolve_offline(&req, Source::Slurm, &here).unwrap();
    assert!(held.port_guard.is_some());
    let again = resolve_offline(&req, Source::Slurm, &here).unwrap_err();
    assert_eq!(
        again.to_string(),
        format!("port 30500 of ps:0 on {me} is already in use")
    );
}
