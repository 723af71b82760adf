//! c10d collectives between real processes: the test binary re-runs itself once per rank
//! (env `SMP_DIST_ROLE`), each rank checks its results against closed-form values.
#![cfg(feature = "runner")]

use std::process::Command;
use std::time::Duration;

use smp_partition::runtime::comm::{Backend, ProcessGroup, RankEnv, Store};
use tch::{Kind, Tensor};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// In the parent: spawns `world` ranks of this test and asserts each exits 0.
/// In a child: returns its rank environment.
fn ranks(test: &str, world: usize) -> Option<RankEnv> {
    if std::env::var("SMP_DIST_ROLE").as_deref() == Ok(test) {
        return RankEnv::from_env().unwrap();
    }
    let port = free_port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env("SMP_DIST_ROLE", test)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {r} of {test} failed: {:?}", out.status);
    }
    None
}

const TIMEOUT: Duration = Duration::from_secs(60);

fn world_group(env: &RankEnv) -> ProcessGroup {
    let store = Store::connect(env, TIMEOUT).unwrap();
    let all: Vec<usize> = (0..env.world).collect();
    ProcessGroup::new(&store, &all, env.rank, TIMEOUT, Backend::Gloo).unwrap()
}

fn vals(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap()
}

#[test]
fn all_reduce_sums_over_three_ranks() {
    let Some(env) = ranks("all_reduce_sums_over_three_ranks", 3) else { return };
    let pg = world_group(&env);
    let r = env.rank as f64;
    let t = Tensor::from_slice(&[r + 1.0, 10.0 * r, -r]);
    pg.all_reduce_sum(&t).unwrap();
    assert_eq!(vals(&t), vec![6.0, 30.0, -3.0]);
    let f = Tensor::full([5], r, (Kind::Float, tch::Device::Cpu));
    pg.all_reduce_sum(&f).unwrap();
    assert_eq!(vals(&f), vec![3.0; 5]);
}

#[test]
fn all_gather_and_reduce_scatter_over_four_ranks() {
    let Some(env) = ranks("all_gather_and_reduce_scatter_over_four_ranks", 4) else { return };
    let pg = world_group(&env);
    let r = env.rank as f64;
    let input = Tensor::from_slice(&[r, r + 0.5]);
    let out = Tensor::zeros([4, 2], (Kind::Double, tch::Device::Cpu));
    pg.all_gather(&out, &input).unwrap();
    assert_eq!(vals(&out), vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
    // rank r holds [r*8 .. r*8+8); the sum over ranks of element i is 4i + 8·(0+1+2+3)
    let input = Tensor::arange(8, (Kind::Double, tch::Device::Cpu)) + 8.0 * r;
    let out = Tensor::zeros([2], (Kind::Double, tch::Device::Cpu));
    pg.reduce_scatter_sum(&out, &input).unwrap();
    let i0 = 2.0 * r;
    assert_eq!(vals(&out), vec![4.0 * i0 + 48.0, 4.0 * (i0 + 1.0) + 48.0]);
}

#[test]
fn broadcast_and_barrier_over_three_ranks() {
    let Some(env) = ranks("broadcast_and_barrier_over_three_ranks", 3) else { return };
    let pg = world_group(&env);
    let t = if env.rank == 2 { Tensor::from_slice(&[7.0f64, 8.0]) } else { Tensor::zeros([2], (Kind::Double, tch::Device::Cpu)) };
    pg.broadcast(&t, 2).unwrap();
    assert_eq!(vals(&t), vec![7.0, 8.0]);
    pg.barrier().unwrap();
}

#[test]
fn send_recv_ring_over_three_ranks() {
    let Some(env) = ranks("send_recv_ring_over_three_ranks", 3) else { return };
    let pg = world_group(&env);
    let (r, n) = (env.rank, env.world);
    let out = Tensor::full([4], r as f64, (Kind::Double, tch::Device::Cpu));
    let into = Tensor::zeros([4], (Kind::Double, tch::Device::Cpu));
    // post both before waiting: a ring of blocking sends would deadlock
    let recv = pg.irecv(&into, (r + n - 1) % n, 3).unwrap();
    let send = pg.isend(&out, (r + 1) % n, 3).unwrap();
    let got = recv.wait().unwrap();
    let _ = send.wait().unwrap();
    assert_eq!(vals(&got), vec![((r + n - 1) % n) as f64; 4]);
}

#[test]
fn subgroups_run_independently() {
    let Some(env) = ranks("subgroups_run_independently", 4) else { return };
    let store = Store::connect(&env, TIMEOUT).unwrap();
    // every rank creates the groups it belongs to in the same global order
    let groups = [vec![0, 2], vec![1, 3], vec![0, 1, 2, 3]];
    let mine: Vec<ProcessGroup> = groups
        .iter()
        .filter(|g| g.contains(&env.rank))
        .map(|g| ProcessGroup::new(&store, g, env.rank, TIMEOUT, Backend::Gloo).unwrap())
        .collect();
    let t = Tensor::from_slice(&[env.rank as f64]);
    mine[0].all_reduce_sum(&t).unwrap();
    let want = if env.rank % 2 == 0 { 2.0 } else { 4.0 };
    assert_eq!(vals(&t), vec![want]);
    let w = Tensor::from_slice(&[1.0f64]);
    mine[1].all_reduce_sum(&w).unwrap();
    assert_eq!(vals(&w), vec![4.0]);
}

#[test]
fn a_missing_peer_times_out_with_an_error() {
    let Some(env) = ranks("a_missing_peer_times_out_with_an_error", 2) else { return };
    let store = Store::connect(&env, TIMEOUT).unwrap();
    let pg = ProcessGroup::new(&store, &[0, 1], env.rank, Duration::from_secs(2), Backend::Gloo).unwrap();
    if env.rank == 0 {
        let into = Tensor::zeros([1], (Kind::Double, tch::Device::Cpu));
        let err = pg.irecv(&into, 1, 9).unwrap().wait().err();
        assert!(err.is_some(), "a receive nobody sends must time out");
    }
    // both ranks meet again so rank 1 outlives rank 0's wait
    let _ = pg.barrier();
}
