use super::*;

fn hosts(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn roles(tasks: &[TaskId]) -> Vec<String> {
    tasks.iter().map(ToString::to_string).collect()
}

#[test]
fn block_placement() {
    let h = hosts("a a a b b b");
    let opts = MappingOptions {
        ps: 2,
        ..Default::default()
    };
    assert_eq!(
        roles(&assign_roles(&h, &opts).unwrap()),
        ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2", "worker:3"]
    );
}

#[test]
fn spread_placement_never_doubles_a_host_while_one_is_free() {
    let h = hosts("a a b b c c");
    let opts = MappingOptions {
        ps: 3,
        placement: Placement::Spread,
        ..Default::default()
    };
    let t = assign_roles(&h, &opts).unwrap();
    assert_eq!(
        roles(&t),
        ["ps:0", "worker:0", "ps:1", "worker:1", "ps:2", "worker:2"]
    );
    // 4 ps on 3 hosts: every host gets one, then host a a second.
    let opts4 = MappingOptions {
        ps: 4,
        ..opts.clone()
    };
    let t = assign_roles(&h, &opts4).unwrap();
    assert_eq!(
        roles(&t),
        ["ps:0", "ps:1", "ps:2", "worker:0", "ps:3", "worker:1"]
    );
    // Hosts interleaved by rank (map-by node): still one ps per host.
    let h = hosts("a b c a b c");
    let t = assign_roles(&h, &MappingOptions { ps: 2, ..opts }).unwrap();
    assert_eq!(
        roles(&t),
        ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2", "worker:3"]
    );
}

#[test]
fn chief_and_evaluator() {
    let h = hosts("a a a a a");
    let opts = MappingOptions {
        ps: 1,
        chief: true,
        evaluator: true,
        ..Default::default()
    };
    assert_eq!(
        roles(&assign_roles(&h, &opts).unwrap()),
        ["ps:0", "chief:0", "worker:0", "worker:1", "evaluator:0"]
    );
    // A chief alone is a valid cluster (it computes); nothing at all is not.
    let h2 = hosts("a a");
    let only_chief = MappingOptions {
        ps: 1,
        chief: true,
        ..Default::default()
    };
    assert_eq!(
        roles(&assign_roles(&h2, &only_chief).unwrap()),
        ["ps:0", "chief:0"]
    );
    let too_many = MappingOptions {
        ps: 1,
        evaluator: true,
        ..Default::default()
    };
    assert_eq!(
        assign_roles(&h2, &too_many).unwrap_err().to_string(),
        "2 ranks are too few for --ps 1 --evaluator: need at least 3"
    );
}

#[test]
fn ps_must_leave_room() {
    let h = hosts("a a");
    let e = assign_roles(
        &h,
        &MappingOptions {
            ps: 2,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--ps 2 must be smaller than the number of ranks (2)"
    );
}

#[test]
fn layout_ports_and_table() {
    let h = hosts("a a b");
    let tasks = assign_roles(
        &h,
        &MappingOptions {
            ps: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let ports = sequential_ports(&h, 2222).unwrap();
    assert_eq!(ports, [2222, 2223, 2222]);
    let l = Layout::from_ranks(&h, &ports, tasks).unwrap();
    assert_eq!(
        l.spec.to_string(),
        r#"{"ps":["a:2222"],"worker":["a:2223","b:2222"]}"#
    );
    let t = l.table("hostfile");
    assert_eq!(
        t,
        "# mpiflow cluster (hostfile): 3 tasks on 2 hosts: ps=1 worker=2\n\
         rank  host local job       task address\n\
         0     a    0     ps        0    a:2222\n\
         1     a    1     worker    0    a:2223\n\
         2     b    0     worker    1    b:2222\n"
    );
    assert!(matches!(
        sequential_ports(&h, 65535),
        Err(MappingError::PortOutOfRange { rank: 1, .. })
    ));
    // Same host and port twice is caught.
    let dup = Layout::from_ranks(
        &hosts("a a"),
        &[1, 1],
        vec![TaskId::new("worker", 0), TaskId::new("worker", 1)],
    );
    assert!(dup
        .unwrap_err()
        .to_string()
        .contains("duplicate address a:1"));
}

#[test]
fn stages_make_replica_jobs_kept_inside_hosts_where_they_fit() {
    let stages = |ps: usize, s: usize| MappingOptions {
        ps,
        stages: Some(s),
        ..Default::default()
    };
    // The ps on a; a's three other ranks hold one whole replica of 2 and a leftover,
    // b's four hold two; the leftover pairs with c's rank.
    let h = hosts("a a a a b b b b c");
    let t = assign_roles(&h, &stages(1, 2)).unwrap();
    assert_eq!(
        roles(&t),
        [
            "ps:0",
            "replica_0:0",
            "replica_0:1",
            "replica_1:0",
            "replica_2:0",
            "replica_2:1",
            "replica_3:0",
            "replica_3:1",
            "replica_1:1"
        ]
    );
    // map-by node: the ranks of a host are not consecutive, its replicas still are.
    let h = hosts("a b a b a b");
    let t = assign_roles(&h, &stages(0, 3)).unwrap();
    assert_eq!(
        roles(&t),
        [
            "replica_0:0",
            "replica_1:0",
            "replica_0:1",
            "replica_1:1",
            "replica_0:2",
            "replica_1:2"
        ]
    );
    // A chief job stays apart; one stage is a replica per rank.
    let chief = MappingOptions {
        chief: true,
        ..stages(1, 1)
    };
    let t = assign_roles(&hosts("a a a"), &chief).unwrap();
    assert_eq!(roles(&t), ["ps:0", "chief:0", "replica_0:0"]);
    let l = Layout::single_host(5, &stages(1, 2)).unwrap();
    assert_eq!(l.spec.num_tasks("replica_1").unwrap(), 2);
    assert!(l.spec.validate_roles().is_ok());
}

#[test]
fn stages_that_do_not_divide_or_fit_are_refused() {
    let opts = MappingOptions {
        ps: 1,
        stages: Some(3),
        ..Default::default()
    };
    let e = assign_roles(&hosts("a a a a a"), &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        "--stages 3: the 4 ranks left for replicas after --ps 1 do not divide into replicas of 3 stages"
    );
    let e = assign_roles(&hosts("a a a"), &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        "3 ranks are too few for --ps 1 --stages 3: need at least 4"
    );
    let none = MappingOptions {
        stages: Some(0),
        ..Default::default()
    };
    assert_eq!(
        assign_roles(&hosts("a a"), &none),
        Err(MappingError::NoStages)
    );
}
