use super::*;
use crate::cluster::TaskId;
use crate::launch::lifetime::stand_in::supervise_one;
use crate::launch::lifetime::{Lifetime, Outcome, Verdict};

/// Threads as launchers of one job (rank 0 a ps that never ends by itself), joined to
/// the star in the order `order` (a late rank 0 included); over TCP on `tcp_port`
/// (and a stranger's connection with another key meanwhile), if given.
fn run_by(
    programs: &[(Option<usize>, i32)],
    order: &[usize],
    tcp_port: Option<u16>,
) -> Vec<(Outcome, Verdict, bool)> {
    let token = format!(
        "mpiflow-test-star-{}-{order:?}-{tcp_port:?}",
        std::process::id()
    );
    let tcp = tcp_port.map(|p| ("127.0.0.1".to_string(), p));
    let n = programs.len();
    let tasks: Vec<(TaskId, Lifetime)> = (0..n)
        .map(|i| match i {
            0 => (TaskId::new("ps", 0), Lifetime::Job),
            i => (TaskId::new("worker", i - 1), Lifetime::Own),
        })
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = order
            .iter()
            .map(|&r| {
                let (token, tasks, tcp) = (token.clone(), tasks.clone(), tcp.clone());
                let (ends_after, status) = programs[r];
                let h = s.spawn(move || {
                    let unix = tcp.is_none();
                    let mut star = Star::join_by(&token, r, n, tcp.clone(), unix).unwrap();
                    let (end, stopped) = supervise_one(&mut star, (ends_after, status), tasks);
                    (r, (end.mine, end.verdict, stopped))
                });
                std::thread::sleep(Duration::from_millis(20));
                if let (0, Some(port)) = (r, tcp_port) {
                    let mut stranger = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    stranger.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                }
                h
            })
            .collect();
        let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        out.sort_by_key(|(r, _)| *r);
        out.into_iter().map(|(_, o)| o).collect()
    })
}

fn run(programs: &[(Option<usize>, i32)], order: &[usize]) -> Vec<(Outcome, Verdict, bool)> {
    run_by(programs, order, None)
}

#[test]
fn launchers_of_other_hosts_join_over_tcp_and_strangers_are_dropped() {
    let free = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let out = run_by(
        &[(None, 0), (Some(3), 0), (Some(30), 0)],
        &[2, 0, 1],
        Some(port),
    );
    assert_eq!(out[0], (Outcome::Stopped, Verdict::Done, true));
    assert_eq!(out[1], (Outcome::Exited(0), Verdict::Done, false));
    assert_eq!(out[2], (Outcome::Exited(0), Verdict::Done, false));
}

#[test]
fn the_tcp_port_is_the_jobs_or_the_variables() {
    let none = crate::test_support::env(&[]);
    let p = tcp_port(&none, "job-a").unwrap();
    assert!((20_000..30_000).contains(&p));
    assert_eq!(tcp_port(&none, "job-a").unwrap(), p);
    let set = crate::test_support::env(&[(PORT_VAR, "31000")]);
    assert_eq!(tcp_port(&set, "job-a"), Ok(31000));
    let bad = crate::test_support::env(&[(PORT_VAR, "0")]);
    assert!(tcp_port(&bad, "job-a")
        .unwrap_err()
        .contains("MPIFLOW_LAUNCH_PORT"));
}

#[test]
fn the_ps_is_stopped_once_the_workers_are_done_whoever_connects_first() {
    for order in [[0, 1, 2], [2, 1, 0]] {
        let out = run(&[(None, 0), (Some(3), 0), (Some(30), 0)], &order);
        assert_eq!(out[0], (Outcome::Stopped, Verdict::Done, true), "{order:?}");
        assert_eq!(out[1], (Outcome::Exited(0), Verdict::Done, false));
        assert_eq!(out[2], (Outcome::Exited(0), Verdict::Done, false));
    }
}

#[test]
fn a_failing_worker_stops_everyone() {
    let out = run(&[(None, 0), (Some(2), 3), (None, 0)], &[1, 0, 2]);
    let failed = Verdict::Failed {
        rank: 1,
        outcome: Outcome::Exited(3),
    };
    assert_eq!(out[0], (Outcome::Stopped, failed.clone(), true));
    assert_eq!(out[1], (Outcome::Exited(3), failed.clone(), false));
    assert_eq!(out[2], (Outcome::Stopped, failed, true));
}

#[test]
fn jobs_have_tokens_of_their_own() {
    let env = |pairs: &[(&str, &str)]| crate::test_support::env(pairs);
    let a = env(&[("OMPI_MCA_orte_hnp_uri", "1.0;tcp://a:1")]);
    let b = env(&[("OMPI_MCA_orte_hnp_uri", "2.0;tcp://a:2")]);
    assert_eq!(job_token(&a, "spec", 3), job_token(&a, "spec", 3));
    assert_ne!(job_token(&a, "spec", 3), job_token(&b, "spec", 3));
    assert_ne!(job_token(&a, "spec", 3), job_token(&a, "spec", 4));
}
