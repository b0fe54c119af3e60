//! The embedding tables' rows a ps holds: pulled by id, updated by sparse gradients as
//! they arrive (asynchronously: a row's update never waits for the step), each row made on
//! its first touch (see [`crate::model::embedding`]).

use super::super::protocol::{
    as_floats, encode_words, inline, payload_tag, reply_tag, row_owner, Reply, RowsPart, Setup,
    PIECE_FLOATS,
};
use super::super::PsError;
use super::requests::Dest;
use super::Server;
use crate::model::embedding::Table;
use crate::train::tables::outgrew;
use crate::transport::comm::Comm;

/// The tables of `setup`, with no rows yet.
pub(super) fn tables(setup: &Setup) -> Result<Vec<Table>, String> {
    match (setup.tables.is_empty(), setup.sparse) {
        (true, _) => Ok(Vec::new()),
        (false, None) => Err("embedding tables without a sparse optimizer".into()),
        (false, Some(opt)) => Ok(setup
            .tables
            .iter()
            .map(|t| Table::new(t.clone(), setup.seed, opt))
            .collect()),
    }
}

impl<C: Comm> Server<'_, C> {
    /// Why this ps's rows, grown by a request of table `table`, no longer fit its memory
    /// share, if they do not.
    pub(super) fn row_room(&self, table: usize) -> Result<(), String> {
        let dense = self.store.len()
            + self
                .slots
                .iter()
                .map(|s| s.m.len() + s.v.len())
                .sum::<usize>();
        let rows: usize = self.tables.iter().map(Table::bytes).sum();
        let held = (4 * dense + rows) as u64;
        let who = format_args!("ps:{}", self.k);
        outgrew(&who, &self.tables[table], held, self.memory.as_ref())
    }

    /// Why rows `ids` of table `table` are not this ps's to serve.
    fn check_rows(&self, table: usize, ids: &[u64]) -> Result<(), String> {
        let Some(t) = self.tables.get(table) else {
            return Err(format!(
                "no embedding table {table} (ps:{} holds {})",
                self.k,
                self.tables.len()
            ));
        };
        let nps = self.roles.ps.len();
        // A pass without a branch per id; the first id astray is looked for only if one is.
        let astray = ids
            .iter()
            .fold(false, |astray, id| astray | (row_owner(*id, nps) != self.k));
        if !astray {
            return Ok(());
        }
        match ids.iter().find(|id| row_owner(**id, nps) != self.k) {
            Some(id) => Err(format!(
                "table {}: row {id} is ps:{}'s, not ps:{}'s",
                t.spec().name,
                row_owner(*id, nps),
                self.k
            )),
            None => Ok(()),
        }
    }

    /// Why the rows `parts` name are not this ps's to serve, if one is not.
    fn check_parts(&self, parts: &[RowsPart]) -> Result<(), String> {
        parts
            .iter()
            .try_for_each(|p| self.check_rows(p.table, &p.ids))
    }

    /// The largest table among `parts`', where rows that outgrew the memory are named.
    fn row_room_of(&self, parts: &[RowsPart]) -> Result<(), String> {
        let largest = parts
            .iter()
            .map(|p| p.table)
            .max_by_key(|t| self.tables[*t].len());
        largest.map_or(Ok(()), |t| self.row_room(t))
    }

    /// The rows `parts` name (checked to be this ps's) appended to `rows`, part by part,
    /// for worker rank `from` (`make`: rows that do not exist are made and the pulls
    /// counted, and the worker's push of the same rows will find them where they are;
    /// else read as their initial values).
    fn gather_rows(
        &mut self,
        (from, parts): (usize, &[RowsPart]),
        make: bool,
        rows: &mut Vec<f32>,
    ) -> Result<(), String> {
        for p in parts {
            let t = &mut self.tables[p.table];
            match make {
                true => t.pull_extend_by(from, &p.ids, rows),
                false => t.read_extend(&p.ids, rows),
            }
            .map_err(|e| e.to_string())?;
            if make {
                let served = &mut self.served[p.table];
                served.pulls += 1;
                served.rows_pulled += p.ids.len() as u64;
            }
        }
        match make {
            true => self.row_room_of(parts),
            false => Ok(()),
        }
    }

    /// Worker rank `from`'s pull of the rows `parts` name (`make`: rows that do not exist
    /// are made, else read as their initial values): a [`Reply::Rows`] with their values,
    /// gathered straight into the reply's message after its header (sent whole if small,
    /// else the header alone and each part's rows as pieces after it).
    pub(super) fn pull_rows(
        &mut self,
        from: usize,
        parts: &[RowsPart],
        make: bool,
    ) -> Result<(), PsError> {
        if let Err(e) = self.check_parts(parts) {
            return self.error(from, e);
        }
        let values = (parts.iter())
            .map(|p| p.ids.len() * self.tables[p.table].spec().dim)
            .sum();
        let mut message = self.flights.message();
        let head = encode_words(&mut message, &Reply::Rows { values });
        if let Err(e) = self.gather_rows((from, parts), make, &mut message) {
            self.flights.unused(message);
            return self.error(from, e);
        }
        let rtag = reply_tag(self.comm);
        let mut sends = Vec::new();
        if inline([values]) {
            sends.push((0..message.len(), rtag));
        } else {
            let data = payload_tag(self.comm);
            sends.push((0..head, rtag));
            // Each part's rows in pieces of their own: the worker may receive each table's
            // straight into its own buffer.
            let mut at = head;
            for p in parts {
                let end = at + p.ids.len() * self.tables[p.table].spec().dim;
                sends.extend((at..end).step_by(PIECE_FLOATS).map(|s| {
                    let piece = s..(s + PIECE_FLOATS).min(end);
                    (piece, data)
                }));
                at = end;
            }
        }
        // Left in flight where the worker takes its rows later (see [`super::flight`]).
        self.flights
            .start(self.comm, from, message, &sends)
            .map_err(PsError::from)
    }

    /// Worker rank `from`'s sparse gradients of the rows `parts` name, scaled by `scale`
    /// (`push`): applied to those rows at once, where they arrived when they came in the
    /// request's message, else once received into `self.rows`; then the rows `pull` names
    /// to the worker as [`Self::pull_rows`] sends them, or `Ok` if none.
    pub(super) fn push_rows(
        &mut self,
        from: usize,
        (parts, scale, pull): (&[RowsPart], f32, &[RowsPart]),
        lens: &[usize],
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let checked = self.check_parts(parts);
        let in_message = match inline(lens.iter().copied()) {
            true => as_floats(inline_bytes),
            false => None,
        };
        let applied = match (checked, in_message) {
            (Ok(()), Some(values)) if values.len() == lens.iter().sum::<usize>() => {
                self.apply_parts((from, parts), scale, values)
            }
            (Ok(()), _) => {
                let taken = self.take_payload(from, lens, inline_bytes, Dest::Rows)?;
                let rows = std::mem::take(&mut self.rows);
                let applied = taken.and_then(|()| self.apply_parts((from, parts), scale, &rows));
                self.rows = rows;
                applied
            }
            (Err(e), _) => {
                // Taken only so the next request starts clean: the ownership error is
                // what the worker hears.
                let _ = self.take_payload(from, lens, inline_bytes, Dest::Drop)?;
                Err(e)
            }
        };
        match applied {
            Ok(()) if pull.is_empty() => self.ok(from),
            Ok(()) => self.pull_rows(from, pull, true),
            Err(e) => self.error(from, e),
        }
    }

    /// Applies worker rank `from`'s gradient rows `values` to the rows `parts` name, part
    /// by part.
    fn apply_parts(
        &mut self,
        (from, parts): (usize, &[RowsPart]),
        scale: f32,
        values: &[f32],
    ) -> Result<(), String> {
        let want: usize = (parts.iter())
            .map(|p| p.ids.len() * self.tables[p.table].spec().dim)
            .sum();
        if want != values.len() {
            return Err(format!(
                "a push of {} gradient values for rows of {want}",
                values.len()
            ));
        }
        let mut at = 0;
        for p in parts {
            let n = p.ids.len() * self.tables[p.table].spec().dim;
            let t = &mut self.tables[p.table];
            t.apply_rows_by(from, &p.ids, &values[at..at + n], scale)
                .map_err(|e| e.to_string())?;
            at += n;
            let served = &mut self.served[p.table];
            served.pushes += 1;
            served.rows_pushed += p.ids.len() as u64;
        }
        self.row_room_of(parts)
    }
}
