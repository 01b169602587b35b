"""Pipecat's own OpenAI realtime service against duplex's `/v1/realtime`, headless.

A Pipecat pipeline as its users write one: a "microphone" that streams a WAV in real time from
the pipeline's start (20 ms chunks of 24 kHz PCM16), Pipecat's `OpenAIRealtimeLLMService` with
its `base_url` pointed at duplex, and a "speaker" that counts the audio it is handed. With
`--context`, the service sits between the context aggregators with a system message, as the
pipeline `pipecat init` generates does (the context goes to the server as
`conversation.item.create`, and an `LLMRunFrame` asks for a response). With `--interrupt-at S`,
a locally driven turn interrupts the agent S seconds in (an `InterruptionFrame`, which makes
the service clear, cancel and truncate).

Every server event goes through Pipecat's own parser (`parse_server_event`), wrapped here only
to count the event types and any failure to parse. Prints one JSON object: the seconds of audio
the speaker got, the server's event types with their counts, the client events the service
sent, the `error` events and the parse failures.
"""

import argparse
import asyncio
import collections
import json
import time
import wave

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    OutputAudioRawFrame,
    StartFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

RATE = 24000

received = collections.Counter()
sent = collections.Counter()
errors = []
parse_failures = []

_parse = events.parse_server_event


def parse(message):
    try:
        event = _parse(message)
    except Exception as e:  # what Pipecat's receive loop would die of
        parse_failures.append(str(e)[:400])
        raise
    kind = json.loads(message).get("type")
    received[kind] += 1
    if kind == "error":
        errors.append(json.loads(message).get("error"))
    return event


events.parse_server_event = parse

_send = OpenAIRealtimeLLMService.send_client_event


async def send_client_event(self, event):
    sent[event.type] += 1
    return await _send(self, event)


OpenAIRealtimeLLMService.send_client_event = send_client_event


class Microphone(FrameProcessor):
    """Streams `pcm` in real time from the pipeline's start; interrupts at `interrupt_at`."""

    def __init__(self, pcm, interrupt_at):
        super().__init__()
        self.pcm = pcm
        self.interrupt_at = interrupt_at
        self.task = None

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            errors.append({"frame": str(frame.error)[:400]})
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame) and self.task is None:
            self.task = self.create_task(self.stream())

    async def stream(self):
        chunk = RATE * 2 // 50
        t0 = time.monotonic()
        interrupted = False
        for i, at in enumerate(range(0, len(self.pcm), chunk)):
            await self.push_frame(
                InputAudioRawFrame(audio=self.pcm[at : at + chunk], sample_rate=RATE, num_channels=1)
            )
            if self.interrupt_at is not None and not interrupted and (i + 1) * 0.02 >= self.interrupt_at:
                interrupted = True
                await self.push_frame(InterruptionFrame())
            await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - time.monotonic()))


class Speaker(FrameProcessor):
    """Counts the seconds of audio it is handed."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputAudioRawFrame):
            self.seconds += len(frame.audio) / (2 * frame.num_channels * frame.sample_rate)
        await self.push_frame(frame, direction)


def read_wav(path):
    with wave.open(path, "rb") as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.readframes(w.getnframes())


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="ws://HOST:PORT/v1/realtime")
    ap.add_argument("--wav", required=True)
    ap.add_argument("--key", default="none")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the call lasts")
    ap.add_argument("--context", action="store_true", help="the pipeline `pipecat init` makes")
    ap.add_argument("--interrupt-at", type=float, default=None)
    a = ap.parse_args()

    llm = OpenAIRealtimeLLMService(api_key=a.key, base_url=a.url)
    mic = Microphone(read_wav(a.wav), a.interrupt_at)
    speaker = Speaker()
    if a.context:
        context = LLMContext(
            [{"role": "system", "content": "You are a friendly assistant. Keep your answers short."}]
        )
        pair = LLMContextAggregatorPair(context)
        processors = [mic, pair.user(), llm, speaker, pair.assistant()]
    else:
        processors = [mic, llm, speaker]
    worker = PipelineWorker(
        Pipeline(processors),
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        cancel_on_idle_timeout=False,
        enable_rtvi=False,
    )
    runner = WorkerRunner(handle_sigint=False)

    async def hang_up():
        if a.context:
            await worker.queue_frames([LLMRunFrame()])
        await asyncio.sleep(a.seconds)
        await worker.queue_frame(EndFrame())

    stop = asyncio.create_task(hang_up())
    await asyncio.wait_for(runner.run(worker), timeout=a.seconds + 30)
    await stop
    print(
        json.dumps(
            {
                "audio_seconds": round(speaker.seconds, 2),
                "received": dict(received),
                "sent": dict(sent),
                "errors": errors,
                "parse_failures": parse_failures,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
