//! The buffers of a transformer of its own ([`OwnTemporal`](super::OwnTemporal)): the cache's
//! sets (two for the standard graph's window, one for fixed shapes), the host-fed cache's round
//! trip, and the fixed-shape step's inputs and outputs.

use ort::memory::Allocator;
use ort::value::TensorElementType;

use super::{ort_err, KvMode};
use crate::model::error::ModelError;
use crate::model::pack::{LmGraphInfo, Variant};
use crate::model::tensors::{allocator_at, element, placement_of, Buffer, Placement};

/// The inputs and outputs of a fixed-shape step, where the session reads and writes them (the
/// memory of the cache, whose allocator views them); the host copies the frame and the mask in
/// and the hidden state and the logits out.
pub(super) struct DeviceIo {
    pub frame: Buffer,
    pub mask: Buffer,
    pub hidden: Buffer,
    pub logits: Buffer,
}

/// The KV cache's buffers: two sets for the standard graph's window (it moves between them),
/// one for the GQA graph's (updated in place), none when the cache lives on the host.
pub(super) fn cache_buffers(
    kv: KvMode,
    info: &LmGraphInfo,
    kv_alloc: &Allocator,
    capacity: usize,
    window: usize,
) -> Result<[Vec<Buffer>; 2], ModelError> {
    let e = ort_err("temporal");
    let (h, d) = (info.heads as i64, info.head_dim as i64);
    let kv_ty = element(info.kv);
    let cache_rows = match (kv, info.variant) {
        (KvMode::Host, _) => 0,
        (KvMode::Resident, Variant::Gqa) => capacity,
        (KvMode::Resident, Variant::Standard) => window.min(capacity),
    };
    let mut bufs: [Vec<Buffer>; 2] = [Vec::new(), Vec::new()];
    let sets = match (kv, info.variant) {
        (KvMode::Resident, Variant::Standard) => 2,
        (KvMode::Resident, Variant::Gqa) => 1,
        (KvMode::Host, _) => 0,
    };
    for set in bufs.iter_mut().take(sets) {
        for _ in 0..2 * info.layers {
            set.push(Buffer::zeros(kv_alloc, kv_ty, &[1, h, cache_rows as i64, d]).map_err(&e)?);
        }
    }
    Ok(bufs)
}

/// The host cache's round trip after a step: every present comes back to the host and is
/// copied into new arrays that become the next step's inputs (the standard graph keeping an
/// exact window). Returns the rows kept before this step's.
pub(super) fn host_presents(
    past: &mut [Buffer],
    outputs: &ort::session::SessionOutputs<'_>,
    info: &LmGraphInfo,
    alloc: &Allocator,
    window: usize,
    total: i64,
) -> Result<usize, ModelError> {
    let e = ort_err("temporal");
    let (h, d) = (info.heads as i64, info.head_dim as i64);
    // The naive round trip: every present comes back to the host and is copied into new
    // arrays that become the next step's inputs.
    let kv_ty = element(info.kv);
    // The standard graph keeps an exact window: drop the oldest row once full.
    let keep = match info.variant {
        Variant::Standard => (total as usize).min(window - 1),
        Variant::Gqa => total as usize,
    };
    let skip = total as usize - keep;
    let row = info.head_dim;
    for i in 0..info.layers {
        for (j, kv) in ["key", "value"].iter().enumerate() {
            let name = format!("present.{i}.{kv}");
            let Some(v) = outputs.get(&name) else {
                return Err(ModelError::contract(
                    "temporal",
                    format!("no output `{name}`"),
                ));
            };
            let mut fresh = Buffer::zeros(alloc, kv_ty, &[1, h, keep as i64, d]).map_err(&e)?;
            for head in 0..info.heads {
                let from = (head * total as usize + skip) * row
                    ..(head * total as usize + total as usize) * row;
                let to = head * keep * row..(head + 1) * keep * row;
                if kv_ty == TensorElementType::Float16 {
                    let (_, src) = v.try_extract_tensor::<half::f16>().map_err(&e)?;
                    fresh.as_slice::<half::f16>()[to].copy_from_slice(&src[from]);
                } else {
                    let (_, src) = v.try_extract_tensor::<f32>().map_err(&e)?;
                    fresh.as_slice::<f32>()[to].copy_from_slice(&src[from]);
                }
            }
            past[2 * i + j] = fresh;
        }
    }
    Ok(keep - 1)
}

impl DeviceIo {
    /// The fixed-shape inputs and outputs, where the session reads and writes them.
    pub(super) fn new(
        session: &ort::session::Session,
        wanted: &[(String, Placement)],
        kv_alloc: &Allocator,
        info: &LmGraphInfo,
        channels: usize,
        capacity: usize,
    ) -> Result<Self, ModelError> {
        let e = ort_err("temporal");
        let at = |name: &str| allocator_at(session, &placement_of(wanted, name));
        let (frame_alloc, mask_alloc) = (
            at("input_frame").map_err(&e)?,
            at("attention_mask").map_err(&e)?,
        );
        let hd = info.hidden_dim as i64;
        Ok(DeviceIo {
            frame: Buffer::zeros(
                &frame_alloc,
                TensorElementType::Int64,
                &[1, channels as i64, 1],
            )
            .map_err(&e)?,
            mask: Buffer::zeros(&mask_alloc, TensorElementType::Int64, &[1, capacity as i64])
                .map_err(&e)?,
            hidden: Buffer::zeros(kv_alloc, element(info.hidden), &[1, 1, hd]).map_err(&e)?,
            logits: Buffer::zeros(kv_alloc, element(info.logits), &[1, 1, info.vocab as i64])
                .map_err(&e)?,
        })
    }
}
