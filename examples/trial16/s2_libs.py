"""trial16 s2: realistic image datasets with large rows: a Hugging Face `datasets` Dataset
(224x224x3 uint8 images, .with_format("numpy")), and a PIL-decoded JPEG dataset returning
np.asarray(img) (HWC uint8, 150 KB rows), with torchvision-style transforms written with torch
ops. Same comparison as s1 (common.py).

    /work/main/.venv/bin/python examples/trial16/s2_libs.py [name-filter]
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datasets
from common import run_cases
from PIL import Image

SCRATCH = "/tmp/trial16/jpeg"
N = 10


def make_jpegs() -> list[str]:
    os.makedirs(SCRATCH, exist_ok=True)
    paths = []
    for i in range(N):
        p = f"{SCRATCH}/{i}.jpg"
        if not os.path.exists(p):
            rng = np.random.default_rng(i)
            # smooth-ish content so the JPEG is realistic, not noise
            base = rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)
            img = Image.fromarray(base).resize((224 + 16 * (i % 3), 224 + 8 * (i % 2)))
            img.save(p, quality=90)
        paths.append(p)
    return paths


def hf_dataset(fmt="numpy"):
    rng = np.random.default_rng(0)
    data = {"image": [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(N)],
            "label": list(range(N)),
            "emb": [rng.standard_normal(9000).astype(np.float32) for _ in range(N)]}
    feats = datasets.Features({"image": datasets.Array3D((224, 224, 3), "uint8"),
                               "label": datasets.Value("int64"),
                               "emb": datasets.Sequence(datasets.Value("float32"), length=9000)})
    return datasets.Dataset.from_dict(data, features=feats).with_format(fmt)


_HF = {}


def hf(fmt="numpy", column=None):
    if fmt not in _HF:
        _HF[fmt] = hf_dataset(fmt)
    ds = _HF[fmt]
    return ds if column is None else Column(ds, column)


class Column(Dataset):
    def __init__(self, ds, column):
        self.ds, self.column = ds, column

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i][self.column]


class Jpegs(Dataset):
    """PIL decode; mode: raw (np.asarray(img) after a center crop to 224), tuple (HWC uint8,
    label), tensor (RandomResizedCrop-ish crop + flip + normalize with torch ops -> CHW f32),
    flipnp (np.fliplr then ascontiguousarray)."""

    def __init__(self, mode):
        self.paths, self.mode = make_jpegs(), mode

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as img:
            img = img.convert("RGB").crop((0, 0, 224, 224))
            arr = np.asarray(img)  # read-only HWC uint8
        if self.mode == "raw":
            return arr
        if self.mode == "tuple":
            return arr, i % 5
        if self.mode == "flipnp":
            return np.ascontiguousarray(arr[:, ::-1]) if i % 2 else arr
        g = torch.Generator().manual_seed(i)
        t = torch.from_numpy(arr.copy()).permute(2, 0, 1)  # CHW uint8 (a permuted view)
        top, left = (int(v) for v in torch.randint(0, 33, (2,), generator=g))
        t = t[:, top:top + 192, left:left + 192]
        t = torch.nn.functional.interpolate(t[None].float(), size=(224, 224), mode="bilinear",
                                            align_corners=False)[0]
        if torch.rand((), generator=g) < 0.5:
            t = t.flip(-1)
        mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
        t = (t - mean) / std
        if self.mode == "tensor":
            return t, i % 5
        return {"pixel_values": t.numpy(), "hwc": arr, "label": i % 5}  # "mixed"


def main(filt: str = "") -> None:
    p = functools.partial
    cases = [
        ("hf numpy dict (image, label, emb)", p(hf, "numpy"), {}),
        ("hf numpy image column", p(hf, "numpy", "image"), {}),
        ("hf numpy emb column (36 KB f32)", p(hf, "numpy", "emb"), {}),
        ("hf torch format dict", p(hf, "torch"), {"expect_cast": False}),
        ("jpeg np.asarray HWC u8", p(Jpegs, "raw"), {}),
        ("jpeg (HWC u8, label)", p(Jpegs, "tuple"), {}),
        ("jpeg fliplr+ascontiguous / as-is", p(Jpegs, "flipnp"), {}),
        ("jpeg torch transforms (CHW f32, label)", p(Jpegs, "tensor"), {"expect_cast": False}),
        ("jpeg dict (f32 CHW numpy, HWC u8, label)", p(Jpegs, "mixed"), {}),
    ]
    run_cases(cases, filt)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
