//! DLRM (Naumov et al., 2019): the recommendation model parameter servers exist for.
//!
//! A bottom MLP turns a sample's dense features into a vector `z` of the embeddings'
//! width; each categorical feature's id picks a row `e_f` of its table; the dot product
//! of every pair of `[z, e_1, ..., e_F]` (their interactions) joins `z` as the input of a
//! top MLP, whose one output is the logit of a click (logistic loss).
//!
//! The MLPs are dense parameters (trained like any model's: by allreduce among workers in
//! hybrid mode); the tables are [`TableSpec`]s whose rows a step obtains for its batch
//! ([`Dlrm::lookups_into`] says which, the caller fills [`Lookup::rows`] from a local
//! [`super::embedding::Table`] or from the ps tasks) and whose gradient is sparse.

use std::ops::Range;

use super::embedding::{Bags, EmbeddingBag, Pooling, SparseGrad, TableSpec, Unique};
use super::layers::{Dense, Layer, Relu};
use super::sequential::Scratch;
use super::{External, ModelError, ParamSpec, Sequential};
use crate::tensor::Tensor;
use crate::train::ctr::CtrBatch;

/// The model: its MLPs and its tables.
pub struct Dlrm {
    dense: usize,
    dim: usize,
    tables: Vec<TableSpec>,
    bottom: Sequential,
    top: Sequential,
    /// The bottom MLP's parameters: the first of [`Dlrm::parameters`], the top's after.
    bottom_params: usize,
}

/// One table's part of a batch: its ids deduplicated, and their rows (`unique.ids` order,
/// filled by the caller).
#[derive(Debug, Clone, Default)]
pub struct Lookup {
    pub unique: Unique,
    pub rows: Vec<f32>,
    /// The batch's ids of the feature, sample by sample.
    ids: Vec<u64>,
    offsets: Vec<usize>,
}

impl Lookup {
    fn bags(&self) -> Bags<'_> {
        Bags {
            ids: &self.ids,
            offsets: &self.offsets,
        }
    }
}

/// A step's buffers, kept from step to step.
#[derive(Default)]
pub struct DlrmScratch {
    bottom: Scratch,
    top: Scratch,
    /// Each sample's `[z, e_1, ..., e_F]`, then their gradients.
    t: Vec<f32>,
    dt: Vec<f32>,
    top_in: Vec<f32>,
    emb: Vec<f32>,
    demb: Vec<f32>,
}

impl Dlrm {
    /// A DLRM over `dense` dense features and `tables` (all of one width, the bottom MLP's
    /// output), with bottom hidden layers `bottom` and top hidden layers `top`.
    pub fn new(
        dense: usize,
        tables: Vec<TableSpec>,
        bottom: &[usize],
        top: &[usize],
    ) -> Result<Dlrm, ModelError> {
        let bad = |why: String| ModelError::Shape {
            model: "dlrm".into(),
            why,
        };
        let dim = tables
            .first()
            .map(|t| t.dim)
            .ok_or_else(|| bad("no tables".into()))?;
        if let Some(t) = tables.iter().find(|t| t.dim != dim) {
            return Err(bad(format!(
                "table {} is {} wide, the first {dim}",
                t.name, t.dim
            )));
        }
        let mlp = |name: &str, input: usize, hidden: &[usize], out: usize, last_relu: bool| {
            let mut layers: Vec<Box<dyn Layer>> = Vec::new();
            for h in hidden {
                layers.push(Box::new(Dense { units: *h }));
                layers.push(Box::new(Relu));
            }
            layers.push(Box::new(Dense { units: out }));
            if last_relu {
                layers.push(Box::new(Relu));
            }
            Sequential::new(name, &[input], layers)
        };
        let pairs = (tables.len() + 1) * tables.len() / 2;
        let bottom = mlp("dlrm bottom", dense, bottom, dim, true)?;
        let bottom_params = super::Model::parameters(&bottom).len();
        Ok(Dlrm {
            dense,
            dim,
            bottom,
            top: mlp("dlrm top", dim + pairs, top, 1, false)?,
            tables,
            bottom_params,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "dlrm {} dense, {} tables of {} ({} rows in all)",
            self.dense,
            self.tables.len(),
            self.dim,
            self.tables.iter().map(|t| t.rows).sum::<u64>()
        )
    }

    pub fn tables(&self) -> &[TableSpec] {
        &self.tables
    }

    /// The MLPs' parameters: `bottom/layerK/w`, ..., then `top/layerK/w`, ...
    pub fn parameters(&self) -> Vec<ParamSpec> {
        fn named(prefix: &str, s: &Sequential) -> Vec<ParamSpec> {
            use super::Model;
            let mut specs = s.parameters();
            specs
                .iter_mut()
                .for_each(|p| p.name = format!("{prefix}/{}", p.name));
            specs
        }
        let mut specs = named("bottom", &self.bottom);
        specs.extend(named("top", &self.top));
        specs
    }

    /// The MLPs' parameters as a model a training mode trains ([`External`]): their
    /// initial values drawn from `seed`, their gradients handed in each step (what
    /// [`crate::train::ctr::fit`] does), while the tables live where the mode keeps them.
    pub fn dense_model(&self, seed: u64) -> Result<External, ModelError> {
        let specs = self.parameters();
        let values = super::initial_values(&specs, seed);
        let named = values
            .into_iter()
            .zip(&specs)
            .map(|(t, s)| t.named(&s.name))
            .collect();
        External::new(&self.describe(), named)
    }

    /// Each table's ids of `batch`, deduplicated, into `lookups` (one per table); their
    /// rows are for the caller to fill. Refuses ids beyond a table's rows.
    pub fn lookups_into(
        &self,
        batch: &CtrBatch,
        lookups: &mut Vec<Lookup>,
    ) -> Result<(), ModelError> {
        if batch.features != self.tables.len() || batch.dense_features != self.dense {
            return Err(ModelError::Shape {
                model: "dlrm".into(),
                why: format!(
                    "takes {} dense features and {} ids a sample; the batch has {} and {}",
                    self.dense,
                    self.tables.len(),
                    batch.dense_features,
                    batch.features
                ),
            });
        }
        lookups.resize_with(self.tables.len(), Lookup::default);
        for (f, (l, spec)) in lookups.iter_mut().zip(&self.tables).enumerate() {
            batch.feature_into(f, &mut l.ids);
            let bags = Bags::one_hot(&l.ids, &mut l.offsets);
            bags.check(spec)?;
            l.unique.of(&l.ids);
        }
        Ok(())
    }

    fn bag(&self) -> EmbeddingBag {
        EmbeddingBag {
            dim: self.dim,
            pooling: Pooling::Sum,
        }
    }

    /// The bottom MLP's parameters and the top's, of [`Dlrm::parameters`].
    fn param_ranges(&self, params: usize) -> (Range<usize>, Range<usize>) {
        (0..self.bottom_params, self.bottom_params..params)
    }

    /// The forward pass to the logits (left in `ws.top`'s output).
    fn forward(
        &self,
        params: &[Tensor],
        batch: &CtrBatch,
        lookups: &[Lookup],
        ws: &mut DlrmScratch,
    ) -> Result<(), ModelError> {
        let (n, d, k) = (batch.len(), self.dim, self.tables.len() + 1);
        let (pb, pt) = self.param_ranges(params.len());
        let rows_wanted = |l: &Lookup| l.unique.ids.len() * d;
        if let Some((f, l)) = lookups
            .iter()
            .enumerate()
            .find(|(_, l)| l.rows.len() != rows_wanted(l))
        {
            return Err(ModelError::Shape {
                model: "dlrm".into(),
                why: format!(
                    "table {}: {} values obtained for {} rows of {d}",
                    self.tables[f].name,
                    l.rows.len(),
                    l.unique.ids.len()
                ),
            });
        }
        let layers = 0..self.bottom.num_layers();
        self.bottom
            .forward_layers(layers, &params[pb], &batch.dense, n, &mut ws.bottom)?;
        ws.t.clear();
        ws.t.resize(n * k * d, 0.0);
        for (s, z) in ws.bottom.output().chunks_exact(d).enumerate() {
            ws.t[s * k * d..s * k * d + d].copy_from_slice(z);
        }
        for (f, l) in lookups.iter().enumerate() {
            self.bag()
                .forward_into(l.bags(), &l.unique, &l.rows, &mut ws.emb);
            for (s, e) in ws.emb.chunks_exact(d).enumerate() {
                let at = (s * k + f + 1) * d;
                ws.t[at..at + d].copy_from_slice(e);
            }
        }
        let width = d + k * (k - 1) / 2;
        ws.top_in.clear();
        ws.top_in.reserve(n * width);
        for t in ws.t.chunks_exact(k * d) {
            ws.top_in.extend_from_slice(&t[..d]);
            for i in 0..k {
                for j in i + 1..k {
                    let dot = t[i * d..(i + 1) * d]
                        .iter()
                        .zip(&t[j * d..(j + 1) * d])
                        .map(|(a, b)| a * b)
                        .sum::<f32>();
                    ws.top_in.push(dot);
                }
            }
        }
        let layers = 0..self.top.num_layers();
        self.top
            .forward_layers(layers, &params[pt], &ws.top_in, n, &mut ws.top)
    }

    /// The logits of `batch` (rows of `lookups` filled).
    pub fn logits(
        &self,
        params: &[Tensor],
        batch: &CtrBatch,
        lookups: &[Lookup],
        ws: &mut DlrmScratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward(params, batch, lookups, ws)?;
        Ok(ws.top.output().to_vec())
    }

    /// The mean logistic loss of `batch` and its gradients: the MLPs' into `grads`
    /// (aligned with [`Dlrm::parameters`]), each table's sparse gradient into `sparse`
    /// (its ids those of the table's lookup).
    pub fn loss_and_gradients(
        &self,
        params: &[Tensor],
        batch: &CtrBatch,
        lookups: &[Lookup],
        grads: &mut [Tensor],
        sparse: &mut Vec<SparseGrad>,
        ws: &mut DlrmScratch,
    ) -> Result<f32, ModelError> {
        self.forward(params, batch, lookups, ws)?;
        let (n, d, k) = (batch.len(), self.dim, self.tables.len() + 1);
        let (pb, pt) = self.param_ranges(params.len());
        let logits = ws.top.output().to_vec();
        let loss = crate::train::ctr::logloss(&logits, &batch.labels) as f32;
        let dz = ws.top.gradient_mut(n);
        for ((g, z), y) in dz.iter_mut().zip(&logits).zip(&batch.labels) {
            *g = (1.0 / (1.0 + (-z).exp()) - y) / n as f32;
        }
        let mut none = |_: Range<usize>, _: &[Tensor]| {};
        let layers = 0..self.top.num_layers();
        let (gb, gt) = grads.split_at_mut(pb.end);
        self.top.backward_layers(
            layers,
            &params[pt],
            &ws.top_in,
            n,
            gt,
            &mut none,
            true,
            &mut ws.top,
        )?;
        // The interactions' gradients back to each vector of [z, e_1, ...].
        let width = d + k * (k - 1) / 2;
        ws.dt.clear();
        ws.dt.resize(n * k * d, 0.0);
        let dtop = ws.top.gradient();
        for s in 0..n {
            let (g, t) = (
                &dtop[s * width..(s + 1) * width],
                &ws.t[s * k * d..(s + 1) * k * d],
            );
            let dt = &mut ws.dt[s * k * d..(s + 1) * k * d];
            dt[..d].copy_from_slice(&g[..d]);
            let mut p = d;
            for i in 0..k {
                for j in i + 1..k {
                    for c in 0..d {
                        dt[i * d + c] += g[p] * t[j * d + c];
                        dt[j * d + c] += g[p] * t[i * d + c];
                    }
                    p += 1;
                }
            }
        }
        let db = ws.bottom.gradient_mut(n * d);
        for (s, g) in db.chunks_exact_mut(d).enumerate() {
            g.copy_from_slice(&ws.dt[s * k * d..s * k * d + d]);
        }
        let layers = 0..self.bottom.num_layers();
        self.bottom.backward_layers(
            layers,
            &params[pb],
            &batch.dense,
            n,
            gb,
            &mut none,
            false,
            &mut ws.bottom,
        )?;
        sparse.resize_with(self.tables.len(), SparseGrad::default);
        for (f, (l, g)) in lookups.iter().zip(sparse.iter_mut()).enumerate() {
            ws.demb.clear();
            for s in 0..n {
                let at = (s * k + f + 1) * d;
                ws.demb.extend_from_slice(&ws.dt[at..at + d]);
            }
            self.bag().backward_into(l.bags(), &l.unique, &ws.demb, g);
        }
        Ok(loss)
    }
}

#[cfg(test)]
mod tests;
