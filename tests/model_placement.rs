//! Every KV buffer is allocated where its session reads that input (ONNX Runtime's own answer
//! for each input of the session), for every graph that holds a cache, on graphs of their own
//! and in the shared engine: the code that puts a CUDA session's caches in device memory is the
//! code that runs here, so a build cannot quietly keep them on the host and copy them over PCIe
//! every step. With the fixed-shape binding of `cuda_graph`, the frame, the mask and the
//! outputs are checked the same way.

#[path = "support/packs.rs"]
mod packs;

use duplex::model::depformer::Depformer;
use duplex::model::engine::{self, EngineOptions};
use duplex::model::pack::Pack;
use duplex::model::session::SessionOptions;
use duplex::model::temporal::{Temporal, TemporalOptions};
use duplex::model::Placement;

fn check(what: &str, places: &[(String, Placement, Placement)], buffers: usize) {
    assert_eq!(places.len(), buffers, "{what}: {places:?}");
    for (input, at, wanted) in places {
        assert_eq!(
            at, wanted,
            "{what}: {input} is at {at}, its session reads it at {wanted}"
        );
        // The CPU provider reads everything from host memory.
        assert_eq!(wanted.device, "Cpu", "{what}: {input}");
    }
}

#[test]
fn every_cache_buffer_is_where_its_session_reads_it() {
    for name in ["tiny", "tiny-gqa", "tiny-gqa-fp16"] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let t = Temporal::open(&pack, &TemporalOptions::default()).unwrap();
        let layers = t.info.layers;
        check(
            &format!("{name} temporal"),
            &t.cache_placements(),
            2 * layers,
        );
        assert!(t.io_placements().is_empty(), "{name}: host-bound I/O");
        if name != "tiny" {
            // The fixed-shape binding `cuda_graph` uses: the cache, and the frame, the mask
            // and the outputs too, where the session reads and writes them.
            let f = Temporal::open(
                &pack,
                &TemporalOptions {
                    fixed_shapes: true,
                    ..Default::default()
                },
            )
            .unwrap();
            check(
                &format!("{name} fixed temporal"),
                &f.cache_placements(),
                2 * layers,
            );
            check(&format!("{name} fixed temporal I/O"), &f.io_placements(), 4);
        }
        let d = Depformer::open(&pack, &SessionOptions::default()).unwrap();
        // Two ping-pong sets of K and V per layer.
        let dl = d.info.layers;
        check(&format!("{name} depformer"), &d.cache_placements(), 4 * dl);
        if name != "tiny" {
            let lm = std::sync::Arc::new(
                engine::SharedLm::open(
                    &pack,
                    &EngineOptions {
                        slots: 2,
                        max_positions: 100,
                        ..Default::default()
                    },
                )
                .unwrap(),
            );
            check(
                &format!("{name} shared engine"),
                &lm.cache_placements,
                2 * layers + 4 * dl,
            );
        }
    }
}

/// Every state buffer of the codec's step graphs (conv tails, counters, K/V rings; both sets of
/// the double-buffered ones) is allocated where its session reads that input, for a codec of
/// its own and for the shared codec's batch, on the tiny and the full-size codec: under CUDA
/// the same code puts them in device memory, so only the frame in and the frame out cross.
#[test]
fn every_codec_state_buffer_is_where_its_session_reads_it() {
    use duplex::model::mimi_step::StepCodec;
    use duplex::model::pack::{FloatType, StepRole};
    for name in ["tiny", "tiny-gqa-mimi-full"] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        for role in [StepRole::Encoder, StepRole::Decoder] {
            for rows in [1, 3] {
                let c = StepCodec::open_rows(
                    &pack,
                    role,
                    FloatType::F32,
                    &SessionOptions::default(),
                    rows,
                )
                .unwrap();
                let buffers: usize = c
                    .manifest
                    .states
                    .iter()
                    .map(|s| if s.inplace { 1 } else { 2 })
                    .sum();
                assert!(buffers > 20, "{name} {role:?}: {buffers} state buffers");
                check(
                    &format!("{name} {role:?} ×{rows}"),
                    &c.state_placements(),
                    buffers,
                );
            }
        }
    }
}
