//! Metric names. Base units: seconds, totals.

/// Histogram, label `stage`: time inside a stage's `process`, without time blocked on outputs.
pub const STAGE_SERVICE: &str = "duplex_stage_service_seconds";
/// Counter, label `stage`: frames processed (or produced, for sources).
pub const STAGE_FRAMES: &str = "duplex_stage_frames_total";
/// Histogram, label `edge`: time a frame waited in an edge's queue.
pub const EDGE_WAIT: &str = "duplex_edge_wait_seconds";
/// Gauge, label `edge`: frames queued in an edge.
pub const EDGE_DEPTH: &str = "duplex_edge_depth";
/// Counter, label `edge`: frames dropped by an edge's overflow policy.
pub const EDGE_DROPPED: &str = "duplex_edge_dropped_total";
/// Histogram, label `stage` (sinks only): interval between completed frames.
pub const COMPLETION_INTERVAL: &str = "duplex_completion_interval_seconds";
/// Gauge = 1, labels `graph`, `execution_provider`, `dtype`: the provider a graph really runs on.
pub const MODEL_INFO: &str = "duplex_model_info";
/// Counter, label `stage`: conversations reset (or stopped) by the long-session policy.
pub const LM_RESETS: &str = "duplex_lm_long_session_total";
/// Gauge, label `stage`: rows in the temporal KV cache (the current attention context).
pub const LM_CONTEXT: &str = "duplex_lm_context_frames";
/// Histogram, label `path` (`mouth_to_ear`): capture instant of a frame → its first sample
/// handed to the output device.
pub const FRAME_LATENCY: &str = "duplex_frame_latency_seconds";
/// Gauge, label `device`: samples queued in the playback jitter buffer, in seconds.
pub const PLAYBACK_DEPTH: &str = "duplex_playback_buffer_seconds";
/// Gauge, label `device`: the jitter buffer's current target depth, in seconds.
pub const PLAYBACK_TARGET: &str = "duplex_playback_target_seconds";
/// Counter, label `device`: underruns (the buffer ran dry while playing).
pub const PLAYBACK_UNDERRUNS: &str = "duplex_playback_underruns_total";
/// Counter, label `device`: silent samples played in place of missing ones.
pub const PLAYBACK_CONCEALED: &str = "duplex_playback_concealed_samples_total";
/// Counter, label `device`: samples dropped (overflow, full ring, device lost).
pub const PLAYBACK_DROPPED: &str = "duplex_playback_dropped_samples_total";
/// Counter, label `device`: times a capture device was lost and reopened.
pub const DEVICE_ERRORS: &str = "duplex_device_errors_total";
/// Gauge: the busiest stage's utilization over the last second (service time / wall time). At
/// or above 1 the pipeline cannot keep up.
pub const REALTIME_FACTOR: &str = "duplex_realtime_factor";
/// Gauge, label `stage`: the stage's utilization over the last second.
pub const STAGE_UTILIZATION: &str = "duplex_stage_utilization";
/// Gauge, labels `stage`, `pattern` (`steady|growth|contention`): 1 for the current verdict.
pub const LATENCY_PATTERN: &str = "duplex_latency_pattern";
/// Gauge, label `stage`: Theil–Sen slope of service time, seconds per 1000 frames.
pub const LATENCY_TREND: &str = "duplex_latency_trend_seconds_per_1k_frames";
/// Gauge, label `stage`: upper cluster centre / lower cluster centre (1 = unimodal).
pub const LATENCY_BIMODALITY: &str = "duplex_latency_bimodality";
/// Gauge, label `stage`: fraction of the window in the slow cluster.
pub const LATENCY_OUTLIERS: &str = "duplex_latency_outlier_fraction";
/// Histogram, labels `stage`, `context`: step time of a stage whose cost may grow with the
/// conversation, by KV-length bucket (`0-374`, `375-749`, … frames).
pub const STAGE_SERVICE_BY_CONTEXT: &str = "duplex_stage_service_by_context_seconds";
/// Histogram, label `direction` (`decode|encode`): time in libopus and the Ogg framing for one
/// chunk of a network client's stream.
pub const OPUS_TIME: &str = "duplex_opus_seconds";
/// Counter, label `what` (`pack|tokenizer|voice|template|engine`): things the process loaded
/// (not taken from its resources): after the first session of a server, none but what changed.
pub const RESOURCES_LOADED: &str = "duplex_resources_loaded_total";
/// Counter, label `result` (`hit|miss`): primings (`priming: cached`) that found their primed
/// state in the process's cache, or computed it.
pub const PRIME_CACHE: &str = "duplex_prime_cache_total";
/// Gauge: bytes of primed states the process keeps.
pub const PRIME_CACHE_BYTES: &str = "duplex_prime_cache_bytes";
/// Counter: primed states dropped to keep the cache within its bytes.
pub const PRIME_CACHE_EVICTIONS: &str = "duplex_prime_cache_evictions_total";
/// Histogram, labels `stage`, `how` (`cached|chunked|stepped`): how long priming a
/// conversation took (the voice prompt, the persona and the spacers, through the temporal
/// transformer and the sampling half), seconds, by how its state was made.
pub const PRIMING: &str = "duplex_priming_seconds";
/// Counter, label `result` (`applied|rejected`): reloads of `duplex serve`'s session template
/// (SIGHUP).
pub const RELOADS: &str = "duplex_template_reloads_total";
/// Gauge: network sessions running now.
pub const SESSIONS_ACTIVE: &str = "duplex_sessions_active";
/// Gauge: sessions the server admits at most (`max_sessions`).
pub const SESSIONS_CAPACITY: &str = "duplex_sessions_capacity";
/// Gauge: 1 while the server takes new sessions at all (its models loaded, not draining, no
/// shared engine failed), whatever its free slots; 0 otherwise. A fleet's free slots are its
/// instances' `capacity - active` where this is 1.
pub const SESSIONS_ACCEPTING: &str = "duplex_sessions_accepting";
/// Counter: sessions admitted.
pub const SESSIONS_ADMITTED: &str = "duplex_sessions_admitted_total";
/// Counter, label `reason` (`full|draining|per_ip|not_ready|rate`, and SIP's
/// `sip_forbidden|sip_auth|sip_bad_offer`): connections refused before the upgrade (`rate`: the
/// client address opened new sessions faster than its allowance; a call refused before its
/// session).
pub const SESSIONS_REFUSED: &str = "duplex_sessions_refused_total";
/// Counter, label `outcome` (`client_closed|idle|stalled|failed|drained|ended|refused`): sessions
/// ended, by why.
pub const SESSIONS_ENDED: &str = "duplex_sessions_ended_total";
/// Histogram: how long sessions lasted, seconds.
pub const SESSION_DURATION: &str = "duplex_session_duration_seconds";
/// Counter, label `direction` (`in|out`): WebSocket payload bytes.
pub const SESSION_BYTES: &str = "duplex_session_bytes_total";
/// Counter, label `direction` (`in|out`): messages dropped because the other side was not
/// taking them (`out`: a client that stopped reading; `in`: a client sending faster than real
/// time).
pub const SESSION_DROPPED: &str = "duplex_session_dropped_messages_total";
/// Counter: 80 ms frames' worth of a client's audio skipped undecoded because it came faster
/// than real time beyond the catch-up allowance (`opus_decode`'s pacing; also packets that
/// claim more audio than the budget holds; on the PCM transports, the connection's budget,
/// charged from the encoded size).
pub const OPUS_REFUSED: &str = "duplex_session_input_refused_frames_total";
/// Counter: 80 ms frames of silence fed in place of a quiet client.
pub const SESSION_SILENCE: &str = "duplex_session_silence_frames_total";
/// Counter: frames whose server latency (a client's frame arriving → the agent's audio for it
/// leaving) passed two frames' time (160 ms).
pub const SESSION_LATE_FRAMES: &str = "duplex_session_late_frames_total";
/// Counter: times a client stopped reading for longer than `stall_timeout` (its session is
/// closed).
pub const SESSION_STALLS: &str = "duplex_session_client_stalls_total";
/// Counter, label `kind` (`unknown_kind|bad_audio|bad_query|too_large|not_binary|flood|
/// bad_utf8|not_json|bad_event|early_audio|sip_malformed|bad_sdp`):
/// protocol errors of clients (`flood`: more messages, pings included, than
/// `limits.max_messages_per_s`).
pub const SESSION_PROTOCOL_ERRORS: &str = "duplex_session_protocol_errors_total";
/// Counter, labels `direction` and `outcome`: WebRTC audio packets. `in`: `received`, `lost`
/// (never came in time), `fec_recovered` and `concealed` (what became of the lost), `late`
/// (came after their time: dropped), `reordered` (came after a later one, in time); `out`:
/// `sent`.
pub const WEBRTC_PACKETS: &str = "duplex_webrtc_packets_total";
/// Counter, labels `method` and `status`: SIP requests answered with a final status of ours
/// (an INVITE's `200`, `401`, `403`, `400`, `488`, `503`; `OPTIONS`; a malformed request's
/// `400`).
pub const SIP_REQUESTS: &str = "duplex_sip_requests_total";
/// Counter, labels `direction` and `outcome`: SIP calls' RTP packets. `in`: `received`,
/// `foreign` (from an address the call did not negotiate: dropped), `malformed`,
/// `other_payload` (comfort noise and the like); `out`: `sent`.
pub const SIP_RTP_PACKETS: &str = "duplex_sip_rtp_packets_total";
/// Counter: DTMF keys callers pressed (RFC 4733 events, SIP INFO).
pub const SIP_DTMF: &str = "duplex_sip_dtmf_total";
/// Counter, label `reason`: SIP requests and connections not passed on to a call, each
/// answered statelessly or dropped before any transaction: `sip_options` (answered),
/// `sip_stray` (no such call: 481, 405, or an ACK dropped), `sip_forged` (a call's request from
/// another party: 403), `sip_forbidden` (outside `sip.allow`: 403), `sip_unsupported` (an unknown
/// `Require`: 420), `sip_malformed` (400), `sip_throttled` (past its sender's allowance:
/// dropped), `sip_too_large` (a datagram over 8 KiB: 513), `sip_auth_throttled` (a guesser's
/// challenges: 403); TCP's `tcp_forbidden`, `tcp_full`, `tcp_silent` (no bytes within 5 s).
pub const SIP_SCREENED: &str = "duplex_sip_screened_total";
/// Gauge: the SIP stack's transactions (live, and finished ones kept for their
/// retransmissions), sampled each second.
pub const SIP_TRANSACTIONS: &str = "duplex_sip_transactions";
/// Gauge: SIP's TCP connections held.
pub const SIP_TCP_CONNECTIONS: &str = "duplex_sip_tcp_connections";
/// Gauge: WebRTC peers the driver holds (connecting, live or closing).
pub const WEBRTC_PEERS: &str = "duplex_webrtc_peers";
/// Counter, label `reason` (`host|bad_request`): HTTP requests refused before any route:
/// a `Host` the server does not serve (`allowed_hosts`), a malformed WebSocket upgrade.
pub const HTTP_REFUSED: &str = "duplex_http_requests_refused_total";
/// Gauge: TCP connections open to the server (sessions, requests, and connections that have
/// not said anything yet).
pub const CONNECTIONS_OPEN: &str = "duplex_connections_open";
/// Counter, label `reason` (`no_request|error`): connections closed by the server before or
/// outside a session (`no_request`: nothing within `limits.handshake_timeout_s`).
pub const CONNECTIONS_CLOSED: &str = "duplex_connections_closed_total";

/// Echo return loss enhancement of an `aec` stage over the recent single talk, dB (`stage`).
pub const AEC_ERLE: &str = "duplex_aec_erle_db";
/// The echo path's delay past the devices as an `aec` stage estimates it (`stage`).
pub const AEC_DELAY: &str = "duplex_aec_delay_seconds";
/// Share of an `aec` stage's recent speaker-active blocks with the user talking too (`stage`).
pub const AEC_DOUBLE_TALK: &str = "duplex_aec_double_talk_ratio";
/// Times an `aec` stage realigned its reference to the capture clock (`stage`).
pub const AEC_REALIGNS: &str = "duplex_aec_realigns_total";

/// Histogram, label `engine` (`temporal|depformer|codec_encoder|codec_decoder`) and, for the
/// temporal engine, `context` (the longest KV context in the batch, in buckets of 375 frames):
/// one batched step of a shared engine (the LM's or a codec's), every session in the tick at
/// once.
pub const ENGINE_TICK: &str = "duplex_engine_tick_seconds";
/// Histogram, label `engine`: sessions stepped in one tick of a shared engine.
pub const ENGINE_BATCH: &str = "duplex_engine_batch_size";
/// Counter: requests a conversation had not submitted when the tick that expected it ran (it is
/// stepped in a later tick; the others did not wait longer for it).
pub const ENGINE_LATE: &str = "duplex_engine_late_frames_total";
/// Gauge: KV slots of the shared LM engine (conversations it can hold).
pub const ENGINE_SLOTS: &str = "duplex_engine_slots";
/// Gauge: shared LM engines open in the process (one per pack, provider and device; an engine
/// whose last conversation has left is closed, its weights freed).
pub const ENGINES_OPEN: &str = "duplex_engines_open";
/// Counter: shared LM engines that failed (their thread panicked; their conversations ended
/// with an error, and the next conversation opened a fresh engine).
pub const ENGINE_FAILURES: &str = "duplex_engine_failures_total";
/// Counter: engine events the metrics thread could not take in time (dropped, not recorded).
pub const ENGINE_EVENTS_DROPPED: &str = "duplex_engine_events_dropped_total";
/// Gauge: KV slots of the shared LM engine in use.
pub const ENGINE_SLOTS_USED: &str = "duplex_engine_slots_used";
/// Gauge, label `engine` (`codec_encoder|codec_decoder`): shared codec engines open (one per
/// pack, role, precision, provider and device; closed when their last conversation leaves).
pub const CODECS_OPEN: &str = "duplex_codec_engines_open";
/// Gauge, label `engine`: slots (batch rows) of the shared codec.
pub const CODEC_SLOTS: &str = "duplex_codec_slots";
/// Gauge, label `engine`: slots of the shared codec in use.
pub const CODEC_SLOTS_USED: &str = "duplex_codec_slots_used";
/// Counter, label `engine`: frames a shared codec's tick expected that had not come (coded in a
/// later tick; the others did not wait longer for them).
pub const CODEC_LATE: &str = "duplex_codec_late_frames_total";
