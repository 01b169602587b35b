//! Every KV buffer is allocated where its session reads that input (ONNX Runtime's own answer
//! for each input of the session), for every graph that holds a cache, on graphs of their own
//! and in the shared engine: the code that puts a CUDA session's caches in device memory is the
//! code that runs here, so a build cannot quietly keep them on the host and copy them over PCIe
//! every step. With the fixed-shape binding of `cuda_graph`, the frame, the mask and the
//! outputs are checked the same way, and the depformer's plain inputs and output in the binding
//! its CUDA graphs need.

use crate::support::packs;

use duplex::model::depformer::{Depformer, DepformerBinding};
use duplex::model::engine::{self, EngineOptions};
use duplex::model::pack::Pack;
use duplex::model::session::SessionOptions;
use duplex::model::temporal::TemporalOptions;
use duplex::model::Placement;

/// The depformer bound as its CUDA graphs bind it.
const SEPARATE: DepformerBinding = DepformerBinding {
    separate_io: true,
    device_sampling: false,
};

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
        let t = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
        let layers = t.info().layers;
        check(
            &format!("{name} temporal"),
            &t.cache_placements(),
            2 * layers,
        );
        assert!(t.io_placements().is_empty(), "{name}: host-bound I/O");
        if name != "tiny" {
            // The fixed-shape binding `cuda_graph` uses: the cache, and the frame, the mask
            // and the outputs too, where the session reads and writes them.
            let f = duplex::model::temporal::open(
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
        assert!(d.io_placements().is_empty());
        // The binding a CUDA graph needs: its plain inputs and output where the session reads.
        let d = Depformer::open_with(&pack, &SessionOptions::default(), SEPARATE).unwrap();
        check(&format!("{name} depformer I/O"), &d.io_placements(), 4);
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

/// The binding the depformer's CUDA graphs need (its plain inputs and output in buffers of
/// their own, fed and read by copies) steps exactly as the plain binding does: the same tokens
/// and the same logits bit for bit, every substep run and the user's skipped, over frames whose
/// hidden states and provided tokens change; with the audio drawn where the logits are (device
/// sampling), the same tokens again. And `cuda_graph` off CUDA is refused, naming why (the same
/// words as the temporal's).
#[test]
fn the_depformers_graph_binding_steps_bit_for_bit_as_the_plain_one() {
    use duplex::model::depformer::{DepformerInput, UnusedSubsteps};
    use duplex::model::sampling::{Sampler, SamplingParams};
    for name in ["tiny-gqa", "tiny-gqa-fp16"] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let opts = SessionOptions::default();
        let mut plain = Depformer::open(&pack, &opts).unwrap();
        let mut graph = Depformer::open_with(&pack, &opts, SEPARATE).unwrap();
        let device = DepformerBinding {
            device_sampling: true,
            ..SEPARATE
        };
        let mut drawn = Depformer::open_with(&pack, &opts, device).unwrap();
        let steps = plain.steps();
        let (mut a, mut b, mut c) = (Sampler::new(7), Sampler::new(7), Sampler::new(7));
        let (mut out_a, mut out_b, mut out_c) = (Vec::new(), Vec::new(), Vec::new());
        for d in [&mut plain, &mut graph] {
            d.keep_logits = true;
        }
        for f in 0..24usize {
            let hidden: Vec<f32> = (0..plain.info.hidden_dim)
                .map(|i| (((i * 37 + f * 11) % 101) as f32 / 50.0 - 1.0) * 2.0)
                .collect();
            let target: Vec<i64> = (0..steps)
                .map(|i| ((i * 131 + f * 17) % 2048) as i64)
                .collect();
            let provided: Vec<bool> = (0..steps).map(|i| i >= steps / 2).collect();
            let frame = DepformerInput {
                hidden: &hidden,
                text: (f % 7) as i64,
                target: &target,
                provided: &provided,
            };
            let mode = if f % 2 == 0 {
                UnusedSubsteps::Run
            } else {
                UnusedSubsteps::Skip
            };
            plain.unused = mode;
            graph.unused = mode;
            drawn.unused = mode;
            plain
                .run(frame, &mut a, SamplingParams::AUDIO, &mut out_a)
                .unwrap();
            graph
                .run(frame, &mut b, SamplingParams::AUDIO, &mut out_b)
                .unwrap();
            drawn
                .run(frame, &mut c, SamplingParams::AUDIO, &mut out_c)
                .unwrap();
            assert_eq!(out_a, out_b, "{name}: frame {f}");
            assert_eq!(out_a, out_c, "{name}: frame {f}, drawn on the device");
            assert_eq!(plain.logits.len(), graph.logits.len());
            for (s, (x, y)) in plain.logits.iter().zip(&graph.logits).enumerate() {
                let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same && x.len() == y.len(), "{name}: frame {f}, substep {s}");
            }
        }
        assert_eq!(plain.counts, graph.counts);
        assert_eq!(plain.counts, drawn.counts);
        assert!(
            plain.counts.1 > 0,
            "the user's substeps were skipped in some frames"
        );
    }
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let opts = SessionOptions {
        cuda_graph: true,
        ..SessionOptions::default()
    };
    let err = Depformer::open(&pack, &opts).err().unwrap().to_string();
    assert!(
        err.contains("`cuda_graph: true` needs `execution_provider: cuda`"),
        "{err}"
    );
}
