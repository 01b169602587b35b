#!/usr/bin/env bash
# `make test` after set-up: the lints, one build of every test target, then the suites in two
# groups that never run side by side, then the image test. Every phase runs even when an earlier
# one failed (a failed build stops only the phases that need it), so one run shows every
# failure; the summary gives each phase's time and the tests' count, and the exit status is 1 if
# anything failed.
#
#   compute    the unit tests, the bad-input suite, `tests/it` `compute::*` and the doc tests:
#              CPU-bound, as many at once as there are cores (libtest's default); but the
#              7B's one-layer export and its check (minutes of Python) run at the lowest
#              priority beside the realtime group, taking the cycles its waiting leaves
#   realtime   `tests/it` `realtime::*`: suites that keep real time or wait on other processes
#              (sound server, daemon, server and its clients, browser, Prometheus), which spend
#              most of their time waiting: DUPLEX_REALTIME_THREADS of them (default 4) at once,
#              beside the longest (three at once, started first) and the image test; then the
#              measurements that others' load would spoil, one at a time. Never beside the
#              CPU-bound group.
#
# DUPLEX_TEST_PHASES (e.g. "build compute") runs only the phases named.
set -uo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
THREADS=${DUPLEX_REALTIME_THREADS:-4}
PHASES=${DUPLEX_TEST_PHASES:-lint build compute realtime image}
LOG=$(mktemp -d)/test.log
failed=()
times=()
built=1

wanted() { [[ " $PHASES " == *" $1 "* ]]; }

# phase NAME COMMAND...: runs one step, its output also into the log; times it; notes a failure.
phase() {
  local name=$1 t0 rc
  shift
  printf '\n== %s: %s\n' "$name" "$*"
  t0=$(date +%s)
  "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  times+=("$name $(($(date +%s) - t0)) s")
  if ((rc != 0)); then
    failed+=("$name (exit $rc)")
  fi
  return "$rc"
}

# The real-time suites' longest tests (26 s to 75 s each; 2026-12-06: about 440 s together),
# on three threads of their own beside the rest (about 640 s on four): the two groups end
# about together (the four threads alone took 194 s while these three idled after 120 s; with
# one more test here, these took 186 s and the four 176 s).
LONG=(
  realtime::daemon::daemon_runs_in_real_time_with_flat_memory_and_no_underruns
  realtime::browser::the_page_says_when_the_server_is_full_and_when_it_goes_away
  realtime::record::live_contention_replayed_headless_is_blamed_on_the_environment
  realtime::hostile_serve::every_transport_pays_for_audio_before_decoding_it
  realtime::serve::bad_clients_are_refused_alone_and_the_healthy_session_never_notices
  realtime::daemon_faults::reloads_good_and_bad_leave_the_last_good_configuration_running
  realtime::serve_resources::later_sessions_load_nothing_and_the_template_changes_only_at_a_reload
  realtime::serve_realtime::the_openai_sdk_holds_greedy_conversations_in_pcm16_and_mu_law
  realtime::serve_replicas::three_replicas_behind_haproxy_admit_the_sum_of_their_slots_over_every_transport
  realtime::hostile_serve::handshakes_time_out_only_audio_keeps_a_call_and_replies_stay_short
  realtime::record::a_killed_run_leaves_a_readable_recording_and_files_rotate_by_size
  realtime::record::a_recorded_run_has_its_manifest_and_every_frames_timings
  realtime::record::a_cost_that_grows_live_and_headless_is_blamed_on_the_code
)
# Measurements of real-time quality that other tests' load would spoil (the browser's
# concealment under packet loss, the echo canceller's double talk on a real echo path and its
# search for a half-second path, whose sound-server timing a busy machine shifts): after the
# rest, one at a time.
APART=(
  realtime::webrtc_loss::under_packet_loss_webrtc_conceals_blips_where_the_websocket_stalls
  realtime::aec::echo_is_cancelled_on_a_real_echo_path_and_the_users_voice_survives
  realtime::aec::a_half_second_echo_path_is_cancelled_once_the_reference_is_delayed
)
# DUPLEX_TEST_TIMES=1: each integration test's time (libtest's --report-time, an unstable
# option: allowed for the test binary alone, which cargo does not see, so nothing is rebuilt).
TIMES=()
IT_ENV=()
if [[ ${DUPLEX_TEST_TIMES:-} == 1 ]]; then
  IT_ENV=(RUSTC_BOOTSTRAP=1)
  TIMES=(-Z unstable-options --report-time)
fi

# it ARGS...: the integration tests' binary (built by the build phase) with ARGS, from the
# checkout's root as `cargo test` runs it.
it_exe() {
  "$CARGO" test --release --test it --no-run --message-format=json 2>/dev/null |
    grep '"name":"it"' | grep -o '"executable":"[^"]*"' | tail -n1 | cut -d'"' -f4
}
it() {
  local exe
  exe=$(it_exe)
  [[ -x $exe ]] || { echo "test: no tests/it binary (the build failed?)"; return 101; }
  env "${IT_ENV[@]}" "$exe" "$@"
}
# The 7B's path at one layer (real widths): its exports (tools/prepare-7b-test.sh, minutes of
# Python, in memory where /dev/shm allows) and their check, at the lowest priority beside the
# real-time suites, whose tests wait on the clock more than they compute.
SEVEN_B=compute::export::the_7b_at_one_layer_exports_with_every_quantization_runs_and_has_the_7bs_inputs
seven_b() {
  local exe dir=/dev/shm/duplex-test-7b-$$ rc
  [[ -d /dev/shm && -w /dev/shm ]] || dir=$PWD/target/test-7b
  exe=$(it_exe)
  [[ -x $exe ]] || { echo "test: no tests/it binary (the build failed?)"; return 101; }
  nice -n 19 tools/prepare-7b-test.sh "$dir" &&
    DUPLEX_TEST_7B=$dir nice -n 19 env "${IT_ENV[@]}" "$exe" --exact "$SEVEN_B" "${TIMES[@]}"
  rc=$?
  rm -rf "$dir"
  return "$rc"
}

bg_names=()
bg_pids=()
bg_logs=()
bg_starts=()
background() {
  local name=$1
  shift
  printf '\n== %s (in the background): %s\n' "$name" "$*"
  bg_names+=("$name")
  bg_logs+=("$(dirname "$LOG")/$name.log")
  bg_starts+=("$(date +%s)")
  "$@" >"${bg_logs[-1]}" 2>&1 &
  bg_pids+=($!)
}
# wait_background [NAME...]: waits for the background steps named (all when none is), prints
# their output and notes their time and failure.
wait_background() {
  local i rc
  for i in "${!bg_pids[@]}"; do
    [[ -z ${bg_pids[$i]} ]] && continue
    if (($#)) && [[ " $* " != *" ${bg_names[$i]} "* ]]; then
      continue
    fi
    wait "${bg_pids[$i]}"
    rc=$?
    bg_pids[$i]=""
    printf '\n== %s (from the background)\n' "${bg_names[$i]}"
    tee -a "$LOG" <"${bg_logs[$i]}"
    times+=("${bg_names[$i]} $(($(date +%s) - ${bg_starts[$i]})) s (beside the others)")
    if ((rc != 0)); then
      failed+=("${bg_names[$i]} (exit $rc)")
    fi
  done
}

t_all=$(date +%s)
# What only the tests need (sound server, Chromium, Prometheus, image tools, the independent
# clients) installs while the lints and the build run: they need none of it.
background setup tools/setup.sh --test
if wanted lint; then
  phase fmt "$CARGO" fmt --check
  phase clippy "$CARGO" clippy --all-targets --release -- -D warnings
  # The CUDA path must compile (it runs only where a GPU build of ONNX Runtime is loaded).
  phase cuda "$CARGO" clippy --release --features cuda --lib --bins -- -D warnings
fi
if wanted build; then
  phase build "$CARGO" test --release --no-run || built=0
fi
wait_background setup
# The tests list each retry there (support::retried): a run says how many it used.
RETRIES=target/test-retries.txt
rm -f "$RETRIES"
if ((built)); then
  if wanted compute; then
    phase unit "$CARGO" test --release --lib --bins
    phase fuzz "$CARGO" test --release --test fuzz_inputs
    phase compute it compute:: --skip "$SEVEN_B" "${TIMES[@]}"
    phase doc "$CARGO" test --release --doc
  fi
  # The image test waits on podman and on its conversation, as the real-time suites wait on
  # theirs: it runs beside them. The longest real-time tests start first, beside the rest.
  if wanted image; then
    background image tools/test-image.sh
  fi
  if wanted compute; then
    background compute-7b seven_b
  fi
  if wanted realtime; then
    background realtime-long it --exact "${LONG[@]}" --test-threads=3 "${TIMES[@]}"
    skips=()
    for t in "${LONG[@]}" "${APART[@]}"; do skips+=(--skip "$t"); done
    phase realtime it realtime:: "${skips[@]}" --test-threads="$THREADS" "${TIMES[@]}"
    wait_background realtime-long
    phase realtime-apart it --exact "${APART[@]}" --test-threads=1 "${TIMES[@]}"
  fi
  wait_background
else
  failed+=("the suites and the image test did not run: the build failed")
fi

passed=$(grep -oE '^test result: [a-zA-Z]+\. [0-9]+ passed' "$LOG" | grep -oE '[0-9]+ passed' | awk '{s += $1} END {print s + 0}')
nfailed=$(grep -oE '^test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$LOG" | grep -oE '[0-9]+ failed' | awk '{s += $1} END {print s + 0}')
printf '\n== summary (%s s in all)\n' "$(($(date +%s) - t_all))"
printf '  %s\n' "${times[@]}"
if ((${#failed[@]})); then
  printf 'failed: %s\n' "${failed[@]}"
  grep -E '^    [a-z_:]+$|^test .* FAILED$' "$LOG" | sed 's/^/  /' | sort -u
fi
if [[ -s $RETRIES ]]; then
  printf 'retries used: %s (the environment failed a stream; each test says why)\n' "$(wc -l <"$RETRIES")"
  sed 's/^/  /' "$RETRIES"
elif wanted realtime; then
  echo "retries used: 0"
fi
echo "tests: $passed passed, $nfailed failed"
((${#failed[@]} == 0))
