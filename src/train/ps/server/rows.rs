//! The embedding tables' rows a ps holds: pulled by id, updated by sparse gradients as
//! they arrive (asynchronously: a row's update never waits for the step), each row made on
//! its first touch (see [`crate::model::embedding`]).

use super::super::protocol::{
    encode, encode_with, f32_bytes, inline, payload_tag, reply_tag, row_owner, Reply, Setup,
    PIECE_FLOATS,
};
use super::super::wire::{send_all_within, Sent};
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
        let who = format!("ps:{}", self.k);
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

    /// Worker rank `from`'s pull of rows `ids` of table `table` (`make`: rows that do not
    /// exist are made, else read as their initial values): a [`Reply::Rows`] with their
    /// values (in the header's message if small, else as pieces after it).
    pub(super) fn pull_rows(
        &mut self,
        from: usize,
        table: usize,
        ids: &[u64],
        make: bool,
    ) -> Result<(), PsError> {
        let pulled = self.check_rows(table, ids).and_then(|()| {
            let mut rows = std::mem::take(&mut self.rows);
            let t = &mut self.tables[table];
            let r = match make {
                true => t.pull_into(ids, &mut rows),
                false => t.read_into(ids, &mut rows),
            };
            if make && r.is_ok() {
                let served = &mut self.served[table];
                served.pulls += 1;
                served.rows_pulled += ids.len() as u64;
            }
            self.rows = rows;
            r.map_err(|e| e.to_string())?;
            self.row_room(table)
        });
        if let Err(e) = pulled {
            return self.error(from, e);
        }
        let reply = Reply::Rows { table };
        let small = inline([self.rows.len()]);
        let header = match small {
            true => encode_with(&reply, &[&self.rows]),
            false => encode(&reply),
        };
        let mut out = vec![(&header[..], from, reply_tag(self.comm))];
        if !small {
            let data = payload_tag(self.comm);
            out.extend(
                self.rows
                    .chunks(PIECE_FLOATS)
                    .map(|p| (f32_bytes(p), from, data)),
            );
        }
        let sent = send_all_within(self.comm, &out, self.timeout, &[], &mut []);
        if matches!(sent, Ok(Sent::Done)) {
            return Ok(());
        }
        // Sends may still be in flight: MPI may read these for as long as the process lives.
        drop(out);
        std::mem::forget(header);
        std::mem::forget(std::mem::take(&mut self.rows));
        sent?;
        Err(self.lose(from))
    }

    /// Worker rank `from`'s sparse gradient of table `table` for rows `ids`, scaled by
    /// `scale`: its payload taken, then applied to those rows at once; `Ok` to the worker.
    pub(super) fn push_rows(
        &mut self,
        from: usize,
        table: usize,
        ids: &[u64],
        scale: f32,
        lens: &[usize],
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let checked = self.check_rows(table, ids);
        let into = match checked {
            Ok(()) => Dest::Rows,
            Err(_) => Dest::Drop,
        };
        let taken = self.take_payload(from, lens, inline_bytes, into)?;
        let applied = checked.and(taken).and_then(|()| {
            self.tables[table]
                .apply_rows(ids, &self.rows, scale)
                .map_err(|e| e.to_string())?;
            let served = &mut self.served[table];
            served.pushes += 1;
            served.rows_pushed += ids.len() as u64;
            self.row_room(table)
        });
        match applied {
            Ok(()) => self.ok(from),
            Err(e) => self.error(from, e),
        }
    }
}
