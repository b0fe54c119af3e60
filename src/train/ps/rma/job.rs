//! Setting up one-sided ps training on every rank: the windows allocated (the shards',
//! and the embedding rows' where the model has tables), each ps's shard restored or
//! initialised, every rank ready before any opens them; then each rank's part (a ps
//! serves, a worker trains in its session, an evaluator evaluates) and the windows freed.

use super::*;

/// A worker's session of one-sided training: the step loop over the [`OneSided`]
/// strategy, on this job's windows (it lives inside [`scope`], which holds them).
/// `'w`: the windows', open for the session's `'a`.
pub type OneSidedSession<'a, 'w, C> =
    Session<'a, 'a, OneSided<'a, C, Open<'w, C, f32>, Open<'w, C, i64>>>;

/// Runs this rank's part of one-sided ps training (collective over `comm`: every rank
/// allocates the windows): the ps tasks serve, the workers train to the end on `train`
/// (evaluating on `test`), the evaluators evaluate the chief's checkpoints.
pub fn run<C: Comm>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &PsConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PsError>
where
    C::Window<f32>: 'static,
    C::Window<i64>: 'static,
{
    crate::model::check_data(model, "train", train.features, train.classes)
        .map_err(|e| PsError::Setup(e.to_string()))?;
    scope(comm, layout, model, cfg, test, events, |sess| {
        crate::train::train_to_end(sess, &cfg.train, train, test).map(drop)
    })
    .map(drop)
}

/// One-sided ps training as the program drives it: every rank of `comm` calls it (a
/// collective: every rank allocates the windows). On a worker it opens the session and
/// hands it to `drive`, whose result it returns; a ps task serves the workers and an
/// evaluator evaluates the chief's checkpoints on `test`, until the workers end, and both
/// return `None`. The windows are freed when it returns, so the session lives inside
/// `drive`.
#[allow(clippy::too_many_arguments)]
pub fn scope<C: Comm, R>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &PsConfig,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
    drive: impl for<'a, 'w> FnOnce(OneSidedSession<'a, 'w, C>) -> Result<R, TrainError>,
) -> Result<Option<R>, PsError>
where
    C::Window<f32>: 'static,
    C::Window<i64>: 'static,
{
    let rows = (!cfg.tables.is_empty()).then(|| rows::RowsConfig::of(cfg, layout));
    scope_with_rows(comm, (layout, model, cfg, rows), test, events, drive)
}

/// [`scope`] with the model's embedding rows (`rows`: their tables and windows) served by
/// the ps tasks beside the dense shards: a worker's session is also its way to them
/// ([`Tables`](crate::train::tables::Tables)).
pub fn scope_with_rows<C: Comm, R>(
    comm: &C,
    (layout, model, cfg, rows): (&Layout, &dyn Model, &PsConfig, Option<rows::RowsConfig>),
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
    drive: impl for<'a, 'w> FnOnce(OneSidedSession<'a, 'w, C>) -> Result<R, TrainError>,
) -> Result<Option<R>, PsError>
where
    C::Window<f32>: 'static,
    C::Window<i64>: 'static,
{
    check_config(cfg, layout)?;
    let roles = Roles::new(layout)?;
    // Every rank places the variables from its own model: one of another model would put
    // its gradients where other variables are.
    let everyone = Collectives::new(comm.split(0, comm.rank())?);
    crate::train::agree_on_model(&everyone, model, |r| roles.task(r))?.map_err(PsError::Setup)?;
    let replica = Replica::new(model, cfg.train.seed);
    let vars = replica.variables();
    let shards = placement::place(&vars, roles.ps.len(), cfg.strategy, cfg.partition_bytes);
    let pieces = pieces(&shards);
    // Every rank finds the same one: the directory does not change before training.
    let (restored, warnings) =
        crate::train::ps::shards::newest(cfg.train.checkpoint_dir.as_deref(), &vars)?;
    let mut windows = Windows::open(comm, &roles, &pieces)?;
    let mut rows = rows
        .map(|r| rows::Job::<C>::open(comm, &roles, r))
        .transpose()?;
    // A ps that cannot restore must not leave the others in the barrier: every rank
    // learns whether all are ready before it.
    let prepared = windows
        .prepare(&replica, &shards, &pieces, restored.as_ref(), cfg)
        .and_then(|state| {
            let rows = match (&mut rows, windows.ps) {
                (Some(job), Some(k)) => Some(job.prepare(k, restored.as_ref())?),
                _ => None,
            };
            Ok((state, rows))
        });
    let ready = rows::ready_everywhere(&everyone, prepared.is_ok());
    let (state, serving) = prepared?;
    ready?;
    let ctx = Rma {
        roles: &roles,
        cfg,
        pieces: &pieces,
        ranks: comm.size(),
        held: windows.held.clone(),
        model_meta: crate::train::checkpoint::state::model_meta(&model.describe(), &vars),
    };
    let placed = placement::report(&shards, &vars, roles.ps.len());
    let notes = start_notes(warnings, restored.as_ref(), placed, layout);
    let result = {
        let mut d = windows.data.open()?;
        let c = windows.ctl.open()?;
        let mut rows_open = rows.as_mut().map(|job| job.open_windows()).transpose()?;
        let dir = cfg.train.checkpoint_dir.as_deref();
        match (state, roles.worker_index(comm.rank())) {
            (Some(state), _) => {
                let mut beside =
                    (rows_open.as_mut().zip(serving)).map(|(o, s)| o.beside(s, &roles));
                let beside = beside.as_mut().map(|b| b as &mut dyn rows::RowsOnPs);
                match cfg.sync {
                    true => ctx.serve_sync(&mut d, &c, state, beside),
                    false => ctx.serve_async(&d, &c, &state, beside),
                }
                .map(|()| None)
            }
            (None, Some(w)) => {
                // Dropped with the strategy on every way out of training, before the
                // windows are freed: the evaluators then end (and come to the free).
                let evaluators = crate::train::sidecar::evaluators(layout);
                let end = crate::train::sidecar::EndNotice::by(w == 0, comm, evaluators, dir);
                let mut worker = OneSided::new(
                    &ctx,
                    w,
                    replica,
                    (&d, &c),
                    notes,
                    restored.as_ref().map(|f| f.step),
                    end,
                );
                if let Some(open) = &rows_open {
                    worker = worker.with_rows(open.worker(&roles, w, restored.as_ref()));
                }
                Session::with_events(worker, &cfg.train, &mut *events)
                    .and_then(drive)
                    .map(Some)
                    .map_err(PsError::from)
            }
            // A model with tables is evaluated by its workers.
            (None, None) if rows_open.is_some() => Ok(None),
            (None, None) => {
                let evaluator = crate::train::sidecar::take_part;
                let taken = evaluator(comm, layout, model, test, dir, events);
                taken.map(|_| None).map_err(PsError::from)
            }
        }
    };
    if result
        .as_ref()
        .is_err_and(|e| !matches!(e, PsError::Stopped(_) | PsError::NotApplied(_)))
    {
        return result;
    }
    // Everyone is past its last operation (a stop or a step not applied ends every rank):
    // the collective frees cannot wait on a failure.
    windows.data.free()?;
    windows.ctl.free()?;
    if let Some(job) = rows {
        job.free()?;
    }
    result
}

/// What the chief says as training starts: the checkpoint's warnings and what it
/// restored, where the variables went, and the one-sided path ([`path_notes`]).
fn start_notes(
    warnings: Vec<String>,
    restored: Option<&crate::train::checkpoint::Found>,
    placed: String,
    layout: &Layout,
) -> Vec<Event> {
    let mut notes: Vec<Event> = warnings.into_iter().map(Event::Warning).collect();
    if let Some(f) = restored {
        notes.push(Event::Restored {
            path: f.path.clone(),
            step: f.step,
        });
    }
    notes.push(Event::Placement(placed));
    notes.extend(path_notes(layout));
    notes
}

/// The chief's notes on the one-sided path (and its cost between hosts without RDMA).
fn path_notes(layout: &Layout) -> Vec<Event> {
    let mut notes = vec![Event::Note(crate::transport::rma::path_note())];
    let hosts: std::collections::BTreeSet<&str> =
        layout.ranks.iter().map(|r| r.host.as_str()).collect();
    if hosts.len() > 1 && crate::transport::rma::rdma_devices().is_empty() {
        notes.push(Event::Warning(format!(
            "{} hosts and no RDMA device: one-sided operations between hosts are emulated over TCP messages that each target must poll for (osc pt2pt, or UCX without RDMA); --transport p2p is about 100x faster there",
            hosts.len()
        )));
    }
    notes
}

/// The windows of one-sided training (see the module's layout), allocated on every rank.
struct Windows<C: Comm> {
    data: C::Window<f32>,
    ctl: C::Window<i64>,
    /// Elements of each ps's parameters (also where its gradient sum starts).
    held: Vec<usize>,
    /// This rank's index among the ps tasks, if it is one.
    ps: Option<usize>,
    workers: usize,
}

impl<C: Comm> Windows<C> {
    /// Allocates the windows (a collective over `comm`).
    fn open(comm: &C, roles: &Roles, pieces: &[Piece]) -> Result<Windows<C>, PsError> {
        let nw = roles.workers.len();
        let mut held = vec![0; roles.ps.len()];
        for p in pieces {
            held[p.ps] += p.len;
        }
        let ps = roles.ps_index(comm.rank());
        let (data_len, ctl_len) = match ps {
            Some(0) => (2 * held[0] + 2, PUSHES + nw + TIME_FIELDS * comm.size()),
            Some(k) => (2 * held[k] + 2, PUSHES + nw),
            None => (0, 0),
        };
        let setup = |e: AllocateError| PsError::Setup(e.to_string());
        Ok(Windows {
            data: comm.window::<f32>(data_len).map_err(setup)?,
            ctl: comm.window::<i64>(ctl_len).map_err(setup)?,
            held,
            ps,
            workers: nw,
        })
    }

    /// A ps: its shards' parameters into its window, from the checkpoint `restored` or
    /// `replica`'s initial values (the same seeded initialiser as every other mode), and
    /// its counters at the starting step; its state. `None` on the other ranks.
    fn prepare(
        &mut self,
        replica: &Replica<'_>,
        shards: &[Shard],
        pieces: &[Piece],
        restored: Option<&crate::train::checkpoint::Found>,
        cfg: &PsConfig,
    ) -> Result<Option<ShardState>, PsError> {
        let Some(k) = self.ps else {
            return Ok(None);
        };
        let mine: Vec<Shard> = shards.iter().filter(|s| s.ps == k).cloned().collect();
        let opt = cfg.train.optimizer;
        let (slots, start) = match restored {
            Some(found) => {
                let (params, slots, step) =
                    crate::train::ps::shards::read(&found.path, &mine, shards, &opt, false)?;
                let at = pieces.iter().filter(|p| p.ps == k).map(|p| p.at);
                let into = |mem: &mut [f32]| {
                    for (a, p) in at.zip(&params) {
                        mem[a..a + p.len()].copy_from_slice(p);
                    }
                };
                // SAFETY: no rank opens the windows before the barrier that follows
                // preparation.
                unsafe { self.data.with_local_mut(into) };
                (slots, step)
            }
            None => {
                let into = |mem: &mut [f32]| {
                    for (p, src) in slices(&replica.params, pieces) {
                        if p.ps == k {
                            mem[p.at..p.at + p.len].copy_from_slice(src);
                        }
                    }
                };
                // SAFETY: as above.
                unsafe { self.data.with_local_mut(into) };
                (mine.iter().map(|s| opt.state(s.len)).collect(), 0)
            }
        };
        let workers = self.workers;
        let counters = |c: &mut [i64]| {
            c[STEP] = start as i64;
            c[SAVED] = start as i64;
            c[SAVE_AT] = start as i64;
            c[PUSHES..PUSHES + workers].fill(start as i64);
        };
        // SAFETY: as above.
        unsafe { self.ctl.with_local_mut(counters) };
        Ok(Some(ShardState {
            k,
            shards: mine,
            slots,
            start,
        }))
    }
}
