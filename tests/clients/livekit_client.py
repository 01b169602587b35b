"""LiveKit Agents' own OpenAI realtime plugin against duplex's `/v1/realtime`, headless.

An agent as LiveKit's users write one, without a room or a LiveKit server: an `AgentSession`
whose `llm` is `livekit.plugins.openai.realtime.RealtimeModel` with its `base_url` pointed at
duplex, whose `input.audio` is a "microphone" streaming a WAV in real time from the session's
start (20 ms `rtc.AudioFrame`s of 24 kHz mono PCM16, silence after the WAV ends), and whose
`output.audio` is a "speaker" that counts the audio it is handed and plays it out on a
simulated clock (it reports `playback_started` / `playback_finished`, interrupted or not, as a
real sink does, so the session's bookkeeping goes on). Started with
`session.start(agent=Agent(instructions=...))`.

With `--generate-reply`, the agent greets first (`session.generate_reply(instructions=...)` right
after `start`, as most LiveKit agents do; `--generate-reply AT` asks AT seconds in): the plugin
sends `response.create` with `metadata.client_event_id` and waits (10 s) for a
`response.created` that echoes it. With `--chat-ctx`, the agent starts with a chat context
holding a system message, which the plugin syncs as `conversation.item.create` (waiting 5 s for
its `conversation.item.added`). With `--interrupt-at S`, `session.interrupt()` S seconds in: the
barge-in that makes the plugin send `response.cancel` and, for what was played,
`conversation.item.truncate`.

Every server event is counted from the plugin's raw `openai_server_event_received` emitter,
every client event from its `openai_client_event_queued` emitter (both attached to each
`RealtimeSession` the model makes). The plugin logs a server event it failed to handle as
"failed to handle event" (with the exception) and goes on: those are caught from the
`livekit.agents` logger. Prints one JSON object: the seconds of audio the speaker got, the
server's and the client's event types with their counts, the `error` events, the handler
failures, the other ERROR/WARNING records of LiveKit's loggers, the first `session.update` the
plugin sent and the last `session.updated` it got, and the outcome of `generate_reply` and of
the interruption when asked for (`--timeline` adds the non-audio events in order, with their
times).
"""

import argparse
import asyncio
import collections
import json
import logging
import time
import traceback
import wave

from livekit import rtc
from livekit.agents import Agent, AgentSession, llm
from livekit.agents.llm._realtime import openai as engine
from livekit.agents.voice import io
from livekit.plugins.openai.realtime import RealtimeModel

RATE = 24000
FRAME = RATE // 50  # 20 ms
AUDIO_EVENTS = ("input_audio_buffer.append", "response.output_audio.delta", "response.audio.delta")

t0 = time.monotonic()
received = collections.Counter()
sent = collections.Counter()
errors = []
response_done = collections.Counter()  # "status/reason" of each `response.done`
handler_failures = []
error_logs = []
warnings = collections.Counter()
timeline = []
first_session_update = None
last_session_updated = None
generate_replies = []
truncates = []
response_created_at = {}  # client_event_id echoed by `response.created` -> seconds since start


def now():
    return round(time.monotonic() - t0, 3)


def on_server_event(event):
    global last_session_updated
    kind = event.get("type")
    received[kind] += 1
    if kind == "session.updated":
        last_session_updated = event.get("session")
    if kind == "error":
        errors.append(event.get("error"))
    if kind == "response.done":
        response = event.get("response") or {}
        details = response.get("status_details") or {}
        reason = details.get("reason") if isinstance(details, dict) else details
        response_done[f"{response.get('status')}/{reason}"] += 1
    if kind == "response.created":
        metadata = (event.get("response") or {}).get("metadata") or {}
        if isinstance(metadata, dict) and metadata.get("client_event_id"):
            response_created_at[metadata["client_event_id"]] = now()
    if kind not in AUDIO_EVENTS:
        timeline.append([now(), "<", kind])


def on_client_event(event):
    global first_session_update
    kind = event.get("type")
    sent[kind] += 1
    if kind == "session.update" and first_session_update is None:
        first_session_update = event
    if kind == "conversation.item.truncate":
        item, end = event.get("item_id"), event.get("audio_end_ms")
        truncates.append({"at": now(), "item_id": item, "audio_end_ms": end})
    if kind not in AUDIO_EVENTS:
        timeline.append([now(), ">", kind])


_session = RealtimeModel.session


def session(self, *args, **kwargs):
    """The model's own session, with the raw event hooks attached before anything is sent."""
    s = _session(self, *args, **kwargs)
    s.on("openai_server_event_received", on_server_event)
    s.on("openai_client_event_queued", on_client_event)
    return s


RealtimeModel.session = session

_generate_reply = engine.RealtimeSession.generate_reply


def generate_reply(self, *args, **kwargs):
    """The plugin's own generate_reply; its future's outcome is recorded."""
    fut = _generate_reply(self, *args, **kwargs)
    record = {"asked_at": now()}
    generate_replies.append(record)

    def done(f):
        record["settled_at"] = now()
        if f.cancelled():
            record["outcome"] = "cancelled"
        elif f.exception() is not None:
            record["outcome"] = f"{type(f.exception()).__name__}: {f.exception()}"
        else:
            record["outcome"] = "response.created"
            record["response_id"] = f.result().response_id
        record["waited_s"] = round(record["settled_at"] - record["asked_at"], 3)

    fut.add_done_callback(done)
    return fut


engine.RealtimeSession.generate_reply = generate_reply


class LogCatcher(logging.Handler):
    """LiveKit's ERROR and WARNING records; "failed to handle event" ones as handler failures."""

    def emit(self, record):
        message = record.getMessage()
        failure = record.exc_info and message == "failed to handle event"
        if record.levelno >= logging.ERROR and failure:
            event = getattr(record, "lk.pii.event", None) or {}
            handler_failures.append(
                {
                    "event": event.get("type") if isinstance(event, dict) else None,
                    "exception": f"{record.exc_info[0].__name__}: {record.exc_info[1]}"[:400],
                    "traceback_tail": "".join(traceback.format_exception(*record.exc_info))
                    .strip()
                    .splitlines()[-3:],
                }
            )
        elif record.levelno >= logging.ERROR:
            entry = {"logger": record.name, "message": message[:400]}
            if record.exc_info:
                entry["exception"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"[:400]
            error_logs.append(entry)
        elif record.levelno >= logging.WARNING:
            warnings[f"{record.name}: {message[:200]}"] += 1


class Microphone(io.AudioInput):
    """Streams `pcm` in real time from the first frame the session reads, then silence."""

    def __init__(self, pcm):
        super().__init__(label="wav-microphone")
        self.pcm = pcm
        self.index = 0
        self.start = None

    async def __anext__(self):
        if self.start is None:
            self.start = time.monotonic()
        else:
            await asyncio.sleep(max(0.0, self.start + self.index * 0.02 - time.monotonic()))
        chunk = self.pcm[self.index * FRAME * 2 : (self.index + 1) * FRAME * 2]
        chunk += bytes(FRAME * 2 - len(chunk))
        self.index += 1
        return rtc.AudioFrame(
            data=chunk, sample_rate=RATE, num_channels=1, samples_per_channel=FRAME
        )


class Speaker(io.AudioOutput):
    """Counts the seconds of audio it is handed and plays them out on a simulated clock.

    A segment starts at its first frame (`on_playback_started`) and ends at `flush()`: it is
    reported played (`on_playback_finished`) once its audio would have played out in real time,
    or interrupted, with the position reached, at `clear_buffer()`.
    """

    def __init__(self):
        super().__init__(
            label="counting-speaker",
            capabilities=io.AudioOutputCapabilities(pause=False),
            sample_rate=RATE,
        )
        self.seconds = 0.0
        self.segments = 0
        self.interrupted_segments = 0
        self.started_at = None  # monotonic time the current segment began to play
        self.pushed = 0.0  # seconds of audio in the current segment
        self.playout = None  # the task that reports the flushed segment played

    async def capture_frame(self, frame):
        await super().capture_frame(frame)
        if self.playout is not None and not self.playout.done():
            await self.playout  # the previous segment plays out first, as a real speaker's would
        if self.started_at is None:
            self.started_at = time.monotonic()
            self.segments += 1
            self.on_playback_started(created_at=time.time())
        self.pushed += frame.duration
        self.seconds += frame.duration

    def flush(self):
        super().flush()
        if self.started_at is None:
            return  # nothing captured: no segment to finish
        self.playout = asyncio.ensure_future(self._play_out(self.started_at, self.pushed))

    async def _play_out(self, started_at, pushed):
        await asyncio.sleep(max(0.0, started_at + pushed - time.monotonic()))
        self._finish(pushed, interrupted=False)

    def clear_buffer(self):
        if self.started_at is None:
            return
        if self.playout is not None and not self.playout.done():
            self.playout.cancel()
        played = min(max(0.0, time.monotonic() - self.started_at), self.pushed)
        self.interrupted_segments += 1
        self._finish(played, interrupted=True)

    def _finish(self, position, interrupted):
        self.started_at = None
        self.pushed = 0.0
        self.on_playback_finished(playback_position=position, interrupted=interrupted)


def read_wav(path):
    with wave.open(path, "rb") as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.readframes(w.getnframes())


async def call(a, speaker, outcome):
    model = RealtimeModel(base_url=a.url, api_key=a.key)
    agent_session = AgentSession(llm=model)
    agent_session.input.audio = Microphone(read_wav(a.wav))
    agent_session.output.audio = speaker

    chat_ctx = None
    if a.chat_ctx:
        chat_ctx = llm.ChatContext()
        chat_ctx.add_message(
            role="system", content="The caller's name is Sam. Greet them by name."
        )
    agent = Agent(
        instructions="You are a friendly assistant. Keep your answers short.", chat_ctx=chat_ctx
    )

    started = time.monotonic()
    await agent_session.start(agent=agent, record=False)
    outcome["start_s"] = round(time.monotonic() - started, 3)

    if a.generate_reply is not None:
        await asyncio.sleep(max(0.0, a.generate_reply - (time.monotonic() - started)))
        handle = agent_session.generate_reply(instructions="Greet the user.")
        outcome["generate_reply"] = {"speech_id": handle.id, "at": now()}

    if a.interrupt_at is not None:
        await asyncio.sleep(max(0.0, a.interrupt_at - (time.monotonic() - started)))
        record = {"at": now(), "agent_state": agent_session.agent_state}
        outcome["interrupt"] = record
        try:
            done = agent_session.interrupt()
            await asyncio.wait_for(asyncio.shield(done), timeout=3)
            record["outcome"] = "done"
        except asyncio.TimeoutError:
            record["outcome"] = "not done after 3 s"
        except Exception as e:  # RuntimeError: nothing interruptible
            record["outcome"] = f"{type(e).__name__}: {e}"
        record["settled_at"] = now()

    await asyncio.sleep(max(0.0, a.seconds - (time.monotonic() - started)))
    if a.generate_reply is not None:
        record = outcome["generate_reply"]
        record["speech_done_at_hang_up"] = handle.done()
        record["speech_interrupted"] = handle.interrupted
        if handle.done() and handle.exception() is not None:
            record["speech_error"] = str(handle.exception())[:400]
    await agent_session.aclose()
    await model.aclose()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="ws://HOST:PORT/v1/realtime")
    ap.add_argument("--wav", required=True, help="24 kHz mono 16-bit")
    ap.add_argument("--key", default="none")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the call lasts")
    ap.add_argument(
        "--generate-reply",
        nargs="?",
        type=float,
        const=0.0,
        metavar="AT",
        help="session.generate_reply(instructions=...) right after start (the agent greets first), "
        "or AT seconds in",
    )
    ap.add_argument(
        "--chat-ctx", action="store_true", help="the agent starts with a system message"
    )
    ap.add_argument(
        "--interrupt-at", type=float, default=None, help="session.interrupt() S seconds in"
    )
    ap.add_argument("--timeline", action="store_true", help="add the non-audio events in order")
    a = ap.parse_args()

    # "livekit" is the parent of the agents' logger ("livekit.agents") and the plugins'
    logging.getLogger("livekit").addHandler(LogCatcher(level=logging.WARNING))
    logging.getLogger("livekit").setLevel(logging.WARNING)

    speaker = Speaker()
    outcome = {}
    try:
        await asyncio.wait_for(call(a, speaker, outcome), timeout=a.seconds + 30)
    except Exception as e:
        outcome["client_failure"] = f"{type(e).__name__}: {e}"[:400]
    for record in generate_replies:
        record.setdefault("outcome", "unsettled")
    if generate_replies and "generate_reply" in outcome:
        outcome["generate_reply"]["plugin_future"] = generate_replies
    if response_created_at:
        outcome["response_created_echoing_client_event_id_at"] = response_created_at
    report = {
        "audio_seconds": round(speaker.seconds, 2),
        "speaker_segments": speaker.segments,
        "speaker_segments_interrupted": speaker.interrupted_segments,
        "received": dict(received),
        "sent": dict(sent),
        "response_done": dict(response_done),
        "errors": errors,
        "handler_failures": handler_failures,
        "error_logs": error_logs,
        "warnings": dict(warnings),
        "truncates": truncates,
        "first_session_update": first_session_update,
        "last_session_updated": last_session_updated,
        **outcome,
    }
    if a.timeline:
        report["timeline"] = timeline
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
