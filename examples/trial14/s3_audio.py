"""Scenario 3: audio: variable-length waveforms read from WAV files (soundfile, scipy.io.wavfile),
pad-and-stack collates returning (padded, lengths), pad_sequence, a PackedSequence from a collate,
random crops by torch's RNG, int16 PCM, stereo; batch_size=None and default collation errors."""

import os
import sys
import tempfile

import numpy as np
import scipy.io.wavfile
import soundfile
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

sys.path.insert(0, os.path.dirname(__file__))
from common import compare, report_end, seeded, shm, variants

N = 13
DIR = tempfile.mkdtemp()
rng = np.random.default_rng(2)
for i in range(N):
    wave = rng.standard_normal(800 + 137 * i).astype(np.float32) * 0.1
    soundfile.write(os.path.join(DIR, f"{i}.flac"), wave, 16000)
    stereo = (rng.standard_normal((500 + 61 * i, 2)) * 3000).astype(np.int16)
    scipy.io.wavfile.write(os.path.join(DIR, f"{i}.wav"), 16000, stereo)


class Flac:
    def __len__(self):
        return N

    def __getitem__(self, i):
        wave, rate = soundfile.read(os.path.join(DIR, f"{i}.flac"), dtype="float32")
        return {"wave": torch.from_numpy(wave), "rate": rate, "label": i % 4, "path": f"{i}.flac"}


class Wav:
    def __len__(self):
        return N

    def __getitem__(self, i):
        rate, pcm = scipy.io.wavfile.read(os.path.join(DIR, f"{i}.wav"))
        return pcm, rate  # int16 (frames, 2), numpy


class CroppedFlac(Flac):
    """A random 600-sample crop drawn from torch's RNG (seeded per worker by the loader)."""

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        start = int(torch.randint(0, len(sample["wave"]) - 600 + 1, ()))
        sample["wave"] = sample["wave"][start:start + 600]
        return sample


def pad_collate(batch):
    waves = [b["wave"] for b in batch]
    lengths = torch.tensor([len(w) for w in waves])
    return pad_sequence(waves, batch_first=True), lengths, torch.tensor([b["label"] for b in batch])


def packed_collate(batch):
    padded, lengths, labels = pad_collate(batch)
    return pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False), labels


def numpy_pad_collate(batch):
    longest = max(len(pcm) for pcm, _ in batch)
    out = np.zeros((len(batch), longest, 2), np.int16)
    for row, (pcm, _) in enumerate(batch):
        out[row, :len(pcm)] = pcm
    return out, np.array([len(pcm) for pcm, _ in batch])


def listed(batch):
    return [b["wave"] for b in batch], [b["path"] for b in batch]


def fresh_crops():
    torch.manual_seed(4)
    return CroppedFlac()


if __name__ == "__main__":
    before = shm()
    base = dict(batch_size=4, shuffle=True)
    for tag, kw in variants(base):
        compare(f"3 pad_sequence, lengths {tag}", Flac(), seeded(dict(kw, collate_fn=pad_collate)))
        compare(f"3 PackedSequence {tag}", Flac(), seeded(dict(kw, collate_fn=packed_collate)))
        compare(f"3 int16 stereo pad {tag}", Wav(), seeded(dict(kw, collate_fn=numpy_pad_collate)))
        compare(f"3 list of tensors {tag}", Flac(), seeded(dict(kw, collate_fn=listed)))
        compare(f"3 random crops default collate {tag}", fresh_crops, seeded(kw))
        compare(f"3 ragged default collate (error) {tag}", Flac(), seeded(kw))
        compare(f"3 batch_size=None {tag}", Wav(), seeded(dict(kw, batch_size=None)),
                extra={"output": "torch"})  # numpy samples: numpy batches otherwise
    report_end(before)
