use super::*;
use serde_json::json;

#[test]
fn dense_and_sparse_jobs() {
    let spec = ClusterSpec::from_json(&json!({
        "worker": ["w0:2222", "w1:2222"],
        "ps": {"1": "p1:2222", "3": "p3:2222"}
    }))
    .unwrap();
    assert_eq!(spec.jobs(), vec!["ps", "worker"]);
    assert_eq!(spec.num_tasks("ps").unwrap(), 2);
    assert_eq!(spec.task_indices("ps").unwrap(), vec![1, 3]);
    assert_eq!(spec.task_address("ps", 3).unwrap().to_string(), "p3:2222");
    assert_eq!(
        spec.job_tasks("ps").unwrap(),
        vec![None, Some("p1:2222".into()), None, Some("p3:2222".into())]
    );
    assert!(spec.is_dense("worker").unwrap());
    assert!(!spec.is_dense("ps").unwrap());
    assert_eq!(
        spec.to_string(),
        r#"{"ps":{"1":"p1:2222","3":"p3:2222"},"worker":["w0:2222","w1:2222"]}"#
    );
    assert!(matches!(
        spec.task_address("ps", 0),
        Err(SpecError::UnknownTask { .. })
    ));
    assert!(matches!(
        spec.num_tasks("chief"),
        Err(SpecError::UnknownJob(_))
    ));
}

#[test]
fn serialisation_is_sorted_whatever_the_input_order() {
    let a = ClusterSpec::from_json(&json!({"worker": ["a:1"], "chief": ["b:1"], "ps": ["c:1"]}))
        .unwrap();
    let b = ClusterSpec::from_json(&json!({"ps": ["c:1"], "chief": ["b:1"], "worker": ["a:1"]}))
        .unwrap();
    assert_eq!(a.to_string(), b.to_string());
    assert!(a.to_string().starts_with(r#"{"chief""#));
}

#[test]
fn chief_rule_and_worker_ids() {
    let with_chief =
        ClusterSpec::from_json(&json!({"chief": ["c:1"], "worker": ["a:1", "b:1"]})).unwrap();
    assert_eq!(with_chief.chief(), Some(TaskId::new("chief", 0)));
    assert_eq!(with_chief.worker_id(&TaskId::new("worker", 1)), Some(2));
    let without = ClusterSpec::from_json(&json!({"worker": ["a:1", "b:1"]})).unwrap();
    assert_eq!(without.chief(), Some(TaskId::new("worker", 0)));
    assert_eq!(without.worker_id(&TaskId::new("worker", 1)), Some(1));
    assert_eq!((with_chief.num_workers(), without.num_workers()), (3, 2));
}

#[test]
fn replica_tasks_name_their_replica_and_stage() {
    let spec = ClusterSpec::from_json(&json!({
        "ps": ["p:1"],
        "replica_0": ["a:1", "a:2"],
        "replica_1": ["b:1", "b:2"]
    }))
    .unwrap();
    assert_eq!(spec.replica_shape(), Some((2, 2)));
    assert_eq!(
        spec.replica_stage(&TaskId::new("replica_1", 0)),
        Some((1, 0))
    );
    assert_eq!(spec.replica_stage(&TaskId::new("ps", 0)), None);
    let uneven = ClusterSpec::from_json(&json!({
        "replica_0": ["a:1", "a:2"],
        "replica_1": ["b:1"]
    }))
    .unwrap();
    assert_eq!(uneven.replica_shape(), None);
    let gap = ClusterSpec::from_json(&json!({"replica_1": ["b:1"]})).unwrap();
    assert_eq!(gap.replica_shape(), None);
}

#[test]
fn replica_jobs_are_a_role_with_a_number() {
    for job in ["replica_0", "replica_7", "replica_12"] {
        assert_eq!(job.parse::<Role>().unwrap(), Role::Replica, "{job}");
    }
    assert_eq!(replica_job(3), "replica_3");
    for job in [
        "replica",
        "replica_",
        "replica_01",
        "replica_x",
        "replica_1a",
        "Replica_1",
    ] {
        assert!(
            matches!(job.parse::<Role>(), Err(SpecError::UnknownRole(_))),
            "{job}"
        );
    }
    let spec =
        ClusterSpec::from_json(&json!({"ps": ["p:1"], "replica_0": ["a:1", "a:2"]})).unwrap();
    assert!(spec.validate_roles().is_ok());
    let bad = ClusterSpec::from_json(&json!({"replica_00": ["a:1"]})).unwrap();
    assert_eq!(
        bad.validate_roles().unwrap_err().to_string(),
        "unknown job type \"replica_00\" (expected chief, worker, ps, evaluator or replica_N)"
    );
}

#[test]
fn bad_specs() {
    let dup = ClusterSpec::from_json(&json!({"worker": ["a:1", "a:1"]})).unwrap_err();
    assert_eq!(
        dup.to_string(),
        "duplicate address a:1: used by worker:0 and worker:1"
    );
    for (v, want) in [
        (json!({"worker": ["a:0"]}), "out of range"),
        (json!({"worker": ["a:70000"]}), "out of range"),
        (json!({"worker": ["a"]}), "expected host:port"),
        (json!({"worker": ["a:x"]}), "not a number"),
        (json!({"worker": []}), "has no tasks"),
        (json!({"worker": {"x": "a:1"}}), "not a number"),
        (json!({"9bad": ["a:1"]}), "invalid job name"),
        (json!({"worker": 3}), "expected a list or a map"),
        (json!(["a:1"]), "must be a JSON object"),
    ] {
        let e = ClusterSpec::from_json(&v).unwrap_err().to_string();
        assert!(e.contains(want), "{v}: {e}");
    }
    let two_chiefs = ClusterSpec::from_json(&json!({"chief": ["a:1", "b:1"]})).unwrap();
    assert!(two_chiefs
        .validate_roles()
        .unwrap_err()
        .to_string()
        .contains("at most one chief"));
    let odd = ClusterSpec::from_json(&json!({"master": ["a:1"]})).unwrap();
    assert!(matches!(
        odd.validate_roles(),
        Err(SpecError::UnknownRole(_))
    ));
}

#[test]
fn ipv6_addresses() {
    let a = Address::parse("[::1]:2222").unwrap();
    assert_eq!(a.host, "::1");
    assert_eq!(a.to_string(), "[::1]:2222");
}
