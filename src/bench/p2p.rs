//! `latency`, `bw`, `bibw`: ranks 0 and 1, OSU's method; other ranks wait.

use std::time::Instant;

use mpi::traits::*;

use super::osu::{self, BenchOptions, Path};
use super::{best_of_rounds, secs, BenchError, Better, Row};
use crate::tensor::{AlignedBuf, DType, Tensor};
use crate::transport::channel::{self, Channel};
use crate::transport::mpi::MpiComm;
use crate::transport::p2p::P2pError;
use crate::transport::{p2p, Collectives, Comm};

const TAG: i32 = 1;
const ACK_TAG: i32 = 2;

fn pattern(size: usize, seed: usize) -> Vec<u8> {
    (0..size).map(|i| ((i * 7 + seed) % 251) as u8).collect()
}

/// How the mpiflow paths move a tensor: a header on every message, or an open channel.
enum Via {
    Headers,
    Channel(Channel),
}

/// A transfer in flight on either mpiflow path.
enum Pending<'a> {
    Send(p2p::SendRequest<'a, MpiComm>),
    Receive(p2p::RecvRequest<'a, MpiComm>),
    ChannelReceive(channel::ChannelReceive<'a, MpiComm>),
}

impl Pending<'_> {
    fn wait(self) -> Result<(), P2pError> {
        match self {
            Pending::Send(r) => r.wait(),
            Pending::Receive(r) => r.wait(),
            Pending::ChannelReceive(r) => r.wait(),
        }
    }
}

impl Via {
    /// The way `path` goes between ranks 0 and 1 for tensors like `t` (opening a channel
    /// is collective between the two).
    fn open(comm: &MpiComm, path: Path, t: &Tensor, peer: usize) -> Result<Via, P2pError> {
        Ok(match path {
            Path::Channel => Via::Channel(Channel::open(comm, t, peer, TAG)?),
            _ => Via::Headers,
        })
    }

    fn send(&self, c: &MpiComm, t: &Tensor, peer: usize) -> Result<(), P2pError> {
        match self {
            Via::Headers => p2p::send(c, t, peer, TAG),
            Via::Channel(ch) => ch.send(c, t),
        }
    }

    fn receive_into(&self, c: &MpiComm, t: &mut Tensor, peer: usize) -> Result<(), P2pError> {
        match self {
            Via::Headers => p2p::receive_into(c, t, peer, TAG),
            Via::Channel(ch) => ch.receive_into(c, t),
        }
    }

    fn immediate_send<'a>(
        &'a self,
        c: &'a MpiComm,
        t: &'a Tensor,
        peer: usize,
    ) -> Result<Pending<'a>, P2pError> {
        Ok(match self {
            Via::Headers => Pending::Send(p2p::immediate_send(c, t, peer, TAG)?),
            Via::Channel(ch) => Pending::Send(ch.immediate_send(c, t)?),
        })
    }

    fn immediate_receive_into<'a>(
        &'a self,
        c: &'a MpiComm,
        t: &'a mut Tensor,
        peer: usize,
    ) -> Result<Pending<'a>, P2pError> {
        Ok(match self {
            Via::Headers => Pending::Receive(p2p::immediate_receive_into(c, t, peer, TAG)?),
            Via::Channel(ch) => Pending::ChannelReceive(ch.immediate_receive_into(c, t)?),
        })
    }
}

/// Seconds for `iters` calls of `step` after `warmup` untimed ones.
fn timed(
    warmup: usize,
    iters: usize,
    mut step: impl FnMut() -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    for _ in 0..warmup {
        step()?;
    }
    let start = Instant::now();
    for _ in 0..iters {
        step()?;
    }
    Ok(secs(start))
}

/// One measurement of one path at one size, on ranks 0 and 1: microseconds (latency) or MB/s.
fn measure(
    comm: &MpiComm,
    name: &str,
    path: Path,
    size: usize,
    opts: &BenchOptions,
) -> Result<f64, BenchError> {
    let (iters, warmup) = match name {
        "latency" => osu::iterations(opts, size, (10000, 100), (1000, 10), 8192),
        _ => osu::iterations(opts, size, (100, 10), (20, 2), 1 << 20),
    };
    let window = if name == "latency" {
        1
    } else {
        opts.window.max(1)
    };
    let me = comm.rank();
    let peer = 1 - me;
    let world = comm.raw();
    let other = world.process_at_rank(peer as i32);
    // bibw: a receive window and a send window on each rank, as OSU.
    let nbuf = if name == "bibw" { 2 * window } else { window };
    let mut bufs: Vec<AlignedBuf> = (0..nbuf).map(|_| AlignedBuf::zeroed(size)).collect();
    let mut tensors: Vec<Tensor> = (0..nbuf)
        .map(|_| Tensor::zeros(DType::U8, &[size]).map(|t| t.named("bench")))
        .collect::<Result<_, _>>()?;
    let mut ack = [0u8; 4];
    let ack_t = Tensor::zeros(DType::U8, &[4])?.named("ack");
    let mut ack_r = ack_t.clone();
    let via = Via::open(comm, path, &tensors[0], peer)?;
    // One tight loop per path, as OSU's: no per-iteration dispatch in the timed code.
    let elapsed = match (name, path) {
        ("latency", Path::Mpi) => timed(warmup, iters, || {
            let b = &mut bufs[0].as_mut_slice()[..size];
            if me == 0 {
                other.send_with_tag(&b[..], TAG);
                other.receive_into_with_tag(b, TAG);
            } else {
                other.receive_into_with_tag(&mut b[..], TAG);
                other.send_with_tag(&b[..], TAG);
            }
            Ok(())
        })?,
        ("latency", _) => timed(warmup, iters, || {
            let t = &mut tensors[0];
            if me == 0 {
                via.send(comm, t, peer)?;
                via.receive_into(comm, t, peer)?;
            } else {
                via.receive_into(comm, t, peer)?;
                via.send(comm, t, peer)?;
            }
            Ok(())
        })?,
        (_, Path::Mpi) => timed(warmup, iters, || {
            let bibw = name == "bibw";
            let (send, recv) = (me == 0 || bibw, me == 1 || bibw);
            if recv {
                let (rb, sb) = bufs.split_at_mut(window);
                mpi::request::scope(|sc| {
                    let recvs: Vec<_> = rb
                        .iter_mut()
                        .map(|b| {
                            other.immediate_receive_into_with_tag(
                                sc,
                                &mut b.as_mut_slice()[..size],
                                TAG,
                            )
                        })
                        .collect();
                    let sends: Vec<_> = if send {
                        sb.iter()
                            .map(|b| other.immediate_send_with_tag(sc, &b.as_slice()[..size], TAG))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    recvs.into_iter().for_each(|r| {
                        r.wait();
                    });
                    sends.into_iter().for_each(|r| {
                        r.wait();
                    });
                });
            } else {
                mpi::request::scope(|sc| {
                    let sends: Vec<_> = bufs
                        .iter()
                        .map(|b| other.immediate_send_with_tag(sc, &b.as_slice()[..size], TAG))
                        .collect();
                    sends.into_iter().for_each(|r| {
                        r.wait();
                    });
                });
            }
            if !bibw {
                if me == 0 {
                    other.receive_into_with_tag(&mut ack[..], ACK_TAG);
                } else {
                    other.send_with_tag(&ack[..], ACK_TAG);
                }
            }
            Ok(())
        })?,
        (_, _) => timed(warmup, iters, || {
            let bibw = name == "bibw";
            let (rt, st) = tensors.split_at_mut(window);
            if me == 1 || bibw {
                let recvs = rt
                    .iter_mut()
                    .map(|t| via.immediate_receive_into(comm, t, peer))
                    .collect::<Result<Vec<_>, _>>()?;
                let sends = if bibw {
                    st.iter()
                        .map(|t| via.immediate_send(comm, t, peer))
                        .collect::<Result<Vec<_>, _>>()?
                } else {
                    Vec::new()
                };
                for r in recvs {
                    r.wait()?;
                }
                for s in sends {
                    s.wait()?;
                }
            } else {
                let sends = rt
                    .iter()
                    .map(|t| via.immediate_send(comm, t, peer))
                    .collect::<Result<Vec<_>, _>>()?;
                for s in sends {
                    s.wait()?;
                }
            }
            if !bibw {
                if me == 0 {
                    p2p::receive_into(comm, &mut ack_r, peer, ACK_TAG)?;
                } else {
                    p2p::send(comm, &ack_t, peer, ACK_TAG)?;
                }
            }
            Ok(())
        })?,
    };
    if opts.validate {
        validate(comm, path, size)?;
    }
    Ok(match name {
        "latency" => elapsed * 1e6 / (2.0 * iters as f64),
        // Both directions count, as in OSU's bibw.
        "bibw" => size as f64 / 1e6 * iters as f64 * (2 * window) as f64 / elapsed,
        _ => size as f64 / 1e6 * iters as f64 * window as f64 / elapsed,
    })
}

/// Sends one patterned message 0 -> 1 on `path` and checks every byte on rank 1.
fn validate(comm: &MpiComm, path: Path, size: usize) -> Result<(), BenchError> {
    let want = pattern(size, size);
    let me = comm.rank();
    let got = match path {
        Path::Mpi => {
            let other = comm.raw().process_at_rank(1 - me as i32);
            let mut b = want.clone();
            if me == 0 {
                other.send_with_tag(&b[..], TAG);
            } else {
                b.fill(0);
                other.receive_into_with_tag(&mut b[..], TAG);
            }
            b
        }
        _ => {
            let mut t = Tensor::from_slice(&[size], &want)?.named("bench");
            let via = Via::open(comm, path, &t, 1 - me)?;
            if me == 0 {
                via.send(comm, &t, 1)?;
            } else {
                t.bytes_mut().fill(0);
                via.receive_into(comm, &mut t, 0)?;
            }
            t.bytes().to_vec()
        }
    };
    match got.iter().zip(&want).position(|(a, b)| a != b) {
        Some(i) => Err(BenchError::Validation(format!(
            "byte {i} of {size} differs on rank {me}"
        ))),
        None => Ok(()),
    }
}

/// Runs latency, bw or bibw over the sizes; returns the text rank 0 prints.
pub fn run(comm: &MpiComm, name: &str, opts: &BenchOptions) -> Result<String, BenchError> {
    let (min, max) = opts.sizes.unwrap_or((1, 1 << 22));
    let (mut paths, nrounds) = opts.plan();
    if opts.path == Path::Both {
        paths.push(Path::Channel);
    }
    let coll = Collectives::new(MpiComm::new(comm.raw()));
    let better = if name == "latency" {
        Better::Lower
    } else {
        Better::Higher
    };
    let rounds = best_of_rounds(
        &coll,
        osu::sizes(min, max),
        &paths,
        nrounds,
        better,
        |path, size| {
            // Ranks 0 and 1 measure; the others only keep the barriers company.
            match comm.rank() {
                0 | 1 => measure(comm, name, path, size, opts),
                _ => Ok(0.0),
            }
            .map(|v| Row::point(size, v, 0))
        },
    )?;
    coll.barrier()?;
    let (title, column) = match name {
        "latency" => ("Latency Test", "Avg Latency(us)"),
        "bw" => ("Bandwidth Test", "Bandwidth (MB/s)"),
        _ => ("Bi-Directional Bandwidth Test", "Bandwidth (MB/s)"),
    };
    Ok(rounds.render(|rows| osu::p2p_table(title, "MPI_CHAR", column, rows)))
}
