#!/usr/bin/env python3
"""Trains a small SentencePiece model for tests: persona text and transcripts.

A stand-in for the PersonaPlex tokenizer (a 32k unigram model that cannot be downloaded here):
the same kind of model, unigram with byte fallback, with ids 0..3 reserved like PersonaPlex's
special text ids (0 EPAD as <unk>, 1 BOS, 2 EOS, 3 PAD). Training is single-threaded on a fixed
text, so the model is the same on every build.

usage: make_tokenizer.py OUT.model
"""
import io
import sys

import sentencepiece as spm

TEXT = """
You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way.
You enjoy having a good conversation. Have a technical discussion about fixing a reactor core.
You work for a bakery that sells bread, cakes and pastries. Greet the customer and take the order.
The weather today is sunny with a light breeze from the west, and the evening will be cool.
Please tell me about your day, what you had for lunch, and where you would like to travel next.
The train leaves the station at nine in the morning and arrives in the city before noon.
She reads books about history, music and science, and she plays the piano every evening.
We talked for hours about the stars, the ocean, the mountains and the small towns between them.
Thank you for calling. How can I help you today? I am sorry to hear that, let me check for you.
"""


def main():
    out = sys.argv[1]
    prefix = out[: -len(".model")] if out.endswith(".model") else out
    sentences = [s.strip() for s in TEXT.strip().splitlines() if s.strip()] * 4
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="unigram",
        vocab_size=400,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=1,
        minloglevel=2,
    )
    with open(prefix + ".model", "wb") as f:
        f.write(model.getvalue())


if __name__ == "__main__":
    main()
