//! A model computed outside mpiflow: its variables are named arrays with initial values,
//! and a program that computes each step's loss and gradients itself (NumPy, PyTorch's
//! autograd, a kernel of its own) hands them in with [`External::run`]. Every mode trains
//! it as any other model (the session's loop, the ps tasks, the allreduce, checkpoints and
//! the guard): the mode only ever asks a model for gradients, and this one answers with
//! the step's.
//!
//! ```
//! use mpiflow::model::External;
//! use mpiflow::prelude::*;
//! use mpiflow::tensor::Tensor;
//! # fn main() -> Result<(), mpiflow::Error> {
//! // One variable, w, minimising (w - 3)^2 by plain SGD.
//! let model = External::new("quadratic", vec![Tensor::from_slice(&[1], &[0.0f32])?.named("w")])?;
//! let cfg = TrainConfig { steps: 100, optimizer: Optimizer::new(OptimizerKind::Sgd, 0.1),
//!                         log_every: 0, ..TrainConfig::default() };
//! let mut sess = Session::new(Local::new(&model, &cfg)?, &cfg)?;
//! while !sess.should_stop() {
//!     let w = sess.replica().params[0].as_slice::<f32>()?[0];
//!     model.run(&mut sess, &[&[2.0 * (w - 3.0)]], (w - 3.0).powi(2), 1)?;
//! }
//! let w = sess.close()?.replica.params[0].as_slice::<f32>()?[0];
//! assert!((w - 3.0).abs() < 1e-4);
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Init, Model, ModelError, ParamSpec, Targets};
use crate::tensor::Tensor;
use crate::train::engine::{Session, StepInfo, Strategy, TrainError};

/// What the next gradient pass of an external model on this thread answers.
enum Handed {
    /// This step's loss and its gradients: where the program's slices are, each of its
    /// variable's length (read only during the [`External::run`] that set them).
    Gradients(f32, Vec<(*const f32, usize)>),
    /// The program's gradients were refused (why): the step fails with it.
    Refused(String),
}

thread_local! {
    /// The step being run on this thread, for the external model of this id: a session
    /// computes a step's gradients on the thread that runs it, and one model may train in
    /// sessions of several threads at once (in-process ranks), each its own step.
    static HANDED: RefCell<Option<(u64, Handed)>> = const { RefCell::new(None) };
}

static IDS: AtomicU64 = AtomicU64::new(0);

/// A model whose loss and gradients are computed by the program (see the module's page).
pub struct External {
    name: String,
    specs: Vec<ParamSpec>,
    initial: Vec<Tensor>,
    id: u64,
}

/// Clears this thread's handed step when the step ends, however it ends.
struct Handing;

impl Handing {
    fn new(id: u64, handed: Handed) -> Handing {
        HANDED.with(|h| *h.borrow_mut() = Some((id, handed)));
        Handing
    }
}

impl Drop for Handing {
    fn drop(&mut self) {
        HANDED.with(|h| *h.borrow_mut() = None);
    }
}

impl std::fmt::Debug for External {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("External")
            .field("name", &self.name)
            .field("variables", &self.specs)
            .finish()
    }
}

impl External {
    /// A model called `name` whose variables are `variables` (each tensor named, f32,
    /// its values the initial ones: the chief's are the job's). An error names a
    /// variable without a name, of another type, or whose name is taken.
    pub fn new(name: &str, variables: Vec<Tensor>) -> Result<External, ModelError> {
        let fail = |why: String| shape_error(name, why);
        if variables.is_empty() {
            return Err(fail("it has no variables".into()));
        }
        let mut specs: Vec<ParamSpec> = Vec::with_capacity(variables.len());
        for (i, v) in variables.iter().enumerate() {
            if v.name().is_empty() {
                return Err(fail(format!("variable {i} has no name")));
            }
            v.as_slice::<f32>()
                .map_err(|e| fail(format!("variable '{}': {e}", v.name())))?;
            if specs.iter().any(|s| s.name == v.name()) {
                return Err(fail(format!("two variables are named '{}'", v.name())));
            }
            specs.push(ParamSpec::new(v.name(), v.shape(), Init::Zeros));
        }
        Ok(External {
            name: name.to_string(),
            specs,
            initial: variables,
            id: IDS.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The variables' names and shapes, in order.
    pub fn variables(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// One step of `sess` (a session training this model) with the program's gradients
    /// `grads` (one slice per variable, in order, of its number of values) of the mean
    /// loss `loss` over this rank's `samples` samples. Gradients of the wrong number or
    /// length fail the step with an error naming the variable, which ends training on
    /// every rank as any failed step does.
    pub fn run<'m, S: Strategy<'m>>(
        &self,
        sess: &mut Session<'m, '_, S>,
        grads: &[&[f32]],
        loss: f32,
        samples: usize,
    ) -> Result<StepInfo, TrainError> {
        let handed = match self.check(grads, samples) {
            Some(why) => Handed::Refused(why),
            None => Handed::Gradients(loss, grads.iter().map(|g| (g.as_ptr(), g.len())).collect()),
        };
        // `grads` outlives the step, which reads them on this thread.
        let _handing = Handing::new(self.id, handed);
        self.step(sess, samples.max(1))
    }

    /// Fails this step of `sess` with `why` (a program's own finding about its step: the
    /// gradients it could not make): training ends on every rank, as with a failed step.
    pub fn refuse<'m, S: Strategy<'m>>(
        &self,
        sess: &mut Session<'m, '_, S>,
        why: String,
    ) -> TrainError {
        let _handing = Handing::new(self.id, Handed::Refused(why));
        match self.step(sess, 1) {
            Err(e) => e,
            Ok(_) => TrainError::Usage("a refused step ran".into()),
        }
    }

    /// Runs the session's step: the samples are told by `samples` target values (this
    /// model has one output and samples of no values).
    fn step<'m, S: Strategy<'m>>(
        &self,
        sess: &mut Session<'m, '_, S>,
        samples: usize,
    ) -> Result<StepInfo, TrainError> {
        sess.run(&[], Targets::Values(&vec![0.0; samples]))
    }

    /// Why `grads` cannot be this step's, if they cannot.
    fn check(&self, grads: &[&[f32]], samples: usize) -> Option<String> {
        if grads.len() != self.specs.len() {
            let names: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
            return Some(format!(
                "{} gradients handed in for its {} variables ({})",
                grads.len(),
                names.len(),
                names.join(", ")
            ));
        }
        if samples == 0 {
            return Some("a step of 0 samples".into());
        }
        let (s, g) = (self.specs.iter().zip(grads)).find(|(s, g)| g.len() != s.numel())?;
        Some(format!(
            "the gradient of {} has {} values, not {}",
            s.describe(),
            g.len(),
            s.numel()
        ))
    }

    fn error(&self, why: String) -> ModelError {
        shape_error(&self.name, why)
    }
}

/// How an external model called `name` is described (its checkpoints record it).
fn described(name: &str) -> String {
    format!("external {name}")
}

/// The error of the external model called `name`: `why`.
fn shape_error(name: &str, why: String) -> ModelError {
    ModelError::Shape {
        model: described(name),
        why,
    }
}

impl Model for External {
    fn describe(&self) -> String {
        described(&self.name)
    }

    /// No input values: the program holds its samples.
    fn input_shape(&self) -> Vec<usize> {
        vec![0]
    }

    fn classes(&self) -> usize {
        1
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    fn initial_values(&self, _seed: u64) -> Vec<Tensor> {
        self.initial.clone()
    }

    fn logits(&self, _: &[Tensor], _: &[f32], _: usize) -> Result<Vec<f32>, ModelError> {
        Err(self.error(
            "its outputs are computed by the program: evaluate there, on the parameters".into(),
        ))
    }

    fn loss_and_gradients(
        &self,
        _: &[Tensor],
        _: &[f32],
        _: Targets<'_>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        let taken = HANDED.with(|h| {
            let mut h = h.borrow_mut();
            match h.take() {
                Some((id, handed)) if id == self.id => Some(handed),
                other => {
                    *h = other;
                    None
                }
            }
        });
        let (loss, from) = match taken {
            Some(Handed::Gradients(loss, from)) => (loss, from),
            Some(Handed::Refused(why)) => return Err(self.error(why)),
            None => {
                return Err(self.error(
                    "no gradients were handed in: its steps are run by External::run".into(),
                ))
            }
        };
        for (g, &(ptr, len)) in grads.iter_mut().zip(&from) {
            // SAFETY: set by `run` from slices it borrows for the whole step, on this
            // thread (the entry is taken here and cleared when `run` returns), and checked
            // there to be this variable's length.
            let src = unsafe { std::slice::from_raw_parts(ptr, len) };
            g.as_mut_slice::<f32>()?.copy_from_slice(src);
        }
        ready(0..grads.len(), grads);
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::engine::Local;
    use crate::train::optim::{Optimizer, OptimizerKind};
    use crate::train::TrainConfig;
    use crate::transport::local::LocalComm;
    use crate::transport::Comm;

    fn quiet(steps: u64) -> TrainConfig {
        TrainConfig {
            steps,
            optimizer: Optimizer::new(OptimizerKind::Momentum, 0.05),
            log_every: 0,
            ..TrainConfig::default()
        }
    }

    #[test]
    fn handed_gradients_train_as_the_model_computed_them() {
        // The MLP's own gradients, handed in from outside, give its own training.
        let mlp = crate::model::mlp(6, &[5], 3).unwrap();
        let cfg = quiet(12);
        let mut rng = crate::rng::Rng::new(5);
        let x: Vec<f32> = (0..8 * 6).map(|_| rng.normal() as f32).collect();
        let y: Vec<u8> = (0..8).map(|i| (i % 3) as u8).collect();
        let mut own = Session::new(Local::new(&mlp, &cfg).unwrap(), &cfg).unwrap();
        let start = crate::model::Replica::new(&mlp, cfg.seed).params;
        let ext = External::new("mlp", start).unwrap();
        let mut outside = Session::new(Local::new(&ext, &cfg).unwrap(), &cfg).unwrap();
        while !own.should_stop() {
            own.run(&x, &y).unwrap();
            let here = crate::model::Replica {
                model: &mlp,
                params: outside.replica().params.clone(),
            };
            let mut g = here.zeros_like();
            let loss = here.gradients_into(&x, &y, &mut g).unwrap();
            let slices: Vec<&[f32]> = g.iter().map(|t| t.as_slice::<f32>().unwrap()).collect();
            ext.run(&mut outside, &slices, loss, 8).unwrap();
        }
        let (a, b) = (own.close().unwrap(), outside.close().unwrap());
        assert_eq!(a.step, b.step);
        assert_eq!(a.loss, b.loss);
        for (p, q) in a.replica.params.iter().zip(&b.replica.params) {
            assert_eq!(p.as_slice::<f32>().unwrap(), q.as_slice::<f32>().unwrap());
        }
    }

    /// A worker's session to its end, handing in the MLP's gradients of its share of the
    /// batch (`data_shard` of `workers`): its trained parameters.
    fn train_share<'m, S: Strategy<'m>>(
        ext: &External,
        mut sess: Session<'m, '_, S>,
        workers: usize,
    ) -> Vec<Tensor> {
        let mlp = crate::model::mlp(6, &[5], 3).unwrap();
        let (x, y) = batch();
        let (k, i) = sess.data_shard();
        assert_eq!(k, workers);
        let rows = i * 8 / k..(i + 1) * 8 / k;
        let (x, y) = (&x[rows.start * 6..rows.end * 6], &y[rows.clone()]);
        while !sess.should_stop() {
            let here = crate::model::Replica {
                model: &mlp,
                params: sess.replica().params.clone(),
            };
            let mut g = here.zeros_like();
            let loss = here.gradients_into(x, y, &mut g).unwrap();
            let g: Vec<&[f32]> = g.iter().map(|t| t.as_slice::<f32>().unwrap()).collect();
            ext.run(&mut sess, &g, loss, rows.len()).unwrap();
        }
        sess.close().unwrap().replica.params
    }

    fn batch() -> (Vec<f32>, Vec<u8>) {
        let mut rng = crate::rng::Rng::new(5);
        let x: Vec<f32> = (0..8 * 6).map(|_| rng.normal() as f32).collect();
        (x, (0..8).map(|i| (i % 3) as u8).collect())
    }

    #[test]
    fn handed_gradients_train_alike_over_the_ps_and_the_allreduce() {
        // Workers' halves of the batch, over the synchronous ps or the allreduce, give
        // local training of the whole batch.
        let mlp = crate::model::mlp(6, &[5], 3).unwrap();
        let steps = 10;
        let (x, y) = batch();
        let cfg = quiet(steps);
        let local = Session::new(Local::new(&mlp, &cfg).unwrap(), &cfg).unwrap();
        let mut local = local;
        while !local.should_stop() {
            local.run(&x, &y).unwrap();
        }
        let want = local.close().unwrap().replica.params;
        let start = crate::model::Replica::new(&mlp, cfg.seed).params;
        let ext = External::new("mlp", start).unwrap();
        let mut ps = crate::train::ps::test_support::cfg(steps, true);
        ps.train = cfg.clone();
        let layout = crate::train::ps::test_support::layout(3, 1);
        let roles = crate::train::ps::Roles::new(&layout).unwrap();
        let by_ps = LocalComm::run(3, |comm| match roles.ps_index(comm.rank()) {
            Some(k) => {
                crate::train::ps::server::serve(&comm, &roles, k, ps.peer_timeout).unwrap();
                None
            }
            None => {
                let sess = Session::for_worker(&comm, &roles, &ext, &ps).unwrap();
                Some(train_share(&ext, sess, 2))
            }
        });
        let ar = crate::train::allreduce::AllreduceConfig {
            train: cfg.clone(),
            ..Default::default()
        };
        let layout = crate::train::ps::test_support::layout(2, 0);
        let by_allreduce = LocalComm::run(2, |comm| {
            let own = comm.split(0, comm.rank()).unwrap();
            let s = crate::train::allreduce::Allreduce::new(own, &layout, comm.rank(), &ext, &ar);
            Some(train_share(
                &ext,
                Session::new(s.unwrap(), &ar.train).unwrap(),
                2,
            ))
        });
        for (how, got) in [("ps", by_ps), ("allreduce", by_allreduce)] {
            let got: Vec<Vec<Tensor>> = got.into_iter().flatten().collect();
            assert_eq!(got.len(), 2, "{how}: both workers' parameters");
            for params in got {
                for (p, q) in params.iter().zip(&want) {
                    let (p, q) = (p.as_slice::<f32>().unwrap(), q.as_slice::<f32>().unwrap());
                    for (a, b) in p.iter().zip(q) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{how}: {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn wrong_gradients_fail_the_step_naming_the_variable() {
        let v = |name: &str, n: usize| {
            Tensor::from_slice(&[n], &vec![0f32; n])
                .unwrap()
                .named(name)
        };
        let ext = External::new("two", vec![v("a", 3), v("b", 2)]).unwrap();
        let cfg = quiet(5);
        let mut sess = Session::new(Local::new(&ext, &cfg).unwrap(), &cfg).unwrap();
        let e = ext
            .run(&mut sess, &[&[0.0; 3], &[0.0; 3]], 1.0, 4)
            .unwrap_err();
        let line = e.to_string();
        assert!(
            line.contains("'b' f32[2]") && line.contains("3 values"),
            "{line}"
        );
        assert!(sess.should_stop(), "a failed step ends the session");
        let mut sess = Session::new(Local::new(&ext, &cfg).unwrap(), &cfg).unwrap();
        let e = ext.run(&mut sess, &[&[0.0; 3]], 1.0, 4).unwrap_err();
        assert!(e
            .to_string()
            .contains("1 gradients handed in for its 2 variables (a, b)"));
        // A step run as for a model of its own has no gradients to take.
        let mut sess = Session::new(Local::new(&ext, &cfg).unwrap(), &cfg).unwrap();
        let e = sess.run(&[], Targets::Values(&[0.0])).unwrap_err();
        assert!(e.to_string().contains("no gradients were handed in"), "{e}");
        // A non-finite loss stops training as the guard stops any model's.
        let mut sess = Session::new(Local::new(&ext, &cfg).unwrap(), &cfg).unwrap();
        let e = ext.run(&mut sess, &[&[0.0; 3], &[0.0; 2]], f32::NAN, 4);
        assert!(e.unwrap_err().to_string().contains("loss"));
    }

    #[test]
    fn one_replicas_refused_step_stops_every_replica() {
        let v = Tensor::from_slice(&[2], &[0f32; 2]).unwrap().named("v");
        let ext = External::new("v", vec![v]).unwrap();
        let ar = crate::train::allreduce::AllreduceConfig {
            train: quiet(5),
            ..Default::default()
        };
        let layout = crate::train::ps::test_support::layout(3, 0);
        let out = LocalComm::run(3, |comm| {
            let own = comm.split(0, comm.rank()).unwrap();
            let s = crate::train::allreduce::Allreduce::new(own, &layout, comm.rank(), &ext, &ar);
            let mut sess = Session::new(s.unwrap(), &ar.train).unwrap();
            ext.run(&mut sess, &[&[1.0, 2.0]], 0.5, 2).unwrap();
            let g: &[f32] = if comm.rank() == 1 {
                &[1.0]
            } else {
                &[1.0, 2.0]
            };
            ext.run(&mut sess, &[g], 0.5, 2).map_err(|e| e.to_string())
        });
        // The others learn which replica failed and why.
        let others = "step 1 failed on 1 of 3 replicas; replica 1: model external v: the gradient of 'v' f32[2] has 1 values, not 2";
        assert_eq!(out[0], Err(others.to_string()));
        assert_eq!(out[2], Err(others.to_string()));
        let own = out[1].as_ref().unwrap_err();
        assert!(
            own.contains("the gradient of 'v' f32[2] has 1 values, not 2"),
            "{own}"
        );
    }

    #[test]
    fn variables_need_unique_names_and_f32() {
        let t = |name: &str| Tensor::from_slice(&[1], &[0f32]).unwrap().named(name);
        let e = External::new("m", vec![t("w"), t("w")]).unwrap_err();
        assert!(e.to_string().contains("two variables are named 'w'"), "{e}");
        let e = External::new("m", vec![t("")]).unwrap_err();
        assert!(e.to_string().contains("variable 0 has no name"), "{e}");
        let i = Tensor::from_slice(&[1], &[1i32]).unwrap().named("i");
        assert!(External::new("m", vec![i]).is_err());
        assert!(External::new("m", vec![]).is_err());
    }
}
