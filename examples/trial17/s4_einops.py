"""trial17 s4: einops transforms in ``__getitem__`` (rearrange to a transposed view, reduce,
patches, repeat; on numpy and on torch samples), ``einops.pack`` shapes as a leaf, a bad
pattern (EinopsError in a worker), and einops in a collate_fn (a non-contiguous numpy batch);
torch's DataLoader beside ArenaLoader with the same options (common.compare).

    .venv/bin/python examples/trial17/s4_einops.py [substring of case names]
"""

from __future__ import annotations

import common
import einops
import numpy as np
import torch


class EinopsImages:
    """HWC uint8 images made CHW by ``rearrange`` (a transposed view), 2x2 mean-pooled by
    ``reduce``, cut into patches, and the label ``repeat``-ed; ``torch``: the same on tensors;
    ``bad``: index 7 uses a pattern that does not fit (EinopsError)."""

    def __init__(self, torch_samples=False, bad=False):
        self.torch_samples, self.bad = torch_samples, bad

    def __len__(self):
        return 18

    def __getitem__(self, i):
        hwc = ((np.arange(8 * 8 * 3) * (i + 1)) % 251).astype(np.uint8).reshape(8, 8, 3)
        x = torch.from_numpy(hwc) if self.torch_samples else hwc
        pattern = "h w c -> c h w" if not (self.bad and i == 7) else "h w -> w h"
        chw = einops.rearrange(x, pattern)
        pooled = einops.reduce(chw.float() if self.torch_samples else chw.astype(np.float32),
                               "c (h 2) (w 2) -> c h w", "mean")
        patches = einops.rearrange(chw, "c (h p1) (w p2) -> (h w) (p1 p2 c)", p1=4, p2=4)
        label = einops.repeat(np.array([i % 4]), "n -> (n r)", r=3)
        return {"chw": chw, "pooled": pooled, "patches": patches, "label": label}


class Packed:
    """``einops.pack`` of two arrays; the packed shapes (lists of tuples of ints) are
    collated as torch collates nested sequences."""

    def __len__(self):
        return 18

    def __getitem__(self, i):
        a, b = np.full((2, 3), i, np.int32), np.arange(3, dtype=np.int32) + i
        packed, shapes = einops.pack([a, b], "* d")
        return {"packed": packed, "shapes": shapes}


def einops_collate(samples):
    """Stack, then channels-last with einops: a non-contiguous numpy batch."""
    chw = np.stack([s["chw"] for s in samples])
    return {"bhwc": einops.rearrange(chw, "b c h w -> b h w c"),
            "label": np.array([s["label"][0] for s in samples])}


if __name__ == "__main__":
    tally = common.Tally()
    compare = common.compare
    compare(tally, "einops numpy", EinopsImages)
    compare(tally, "einops torch", lambda: EinopsImages(torch_samples=True))
    compare(tally, "einops bad pattern (raises)", lambda: EinopsImages(bad=True),
            configs=common.ERROR_CONFIGS)
    compare(tally, "einops pack shapes", Packed)
    # output="torch" makes the collate_fn's numpy arrays tensors (README): compared untyped
    compare(tally, "einops collate_fn", EinopsImages, collate_fn=einops_collate,
            torch_types=False)
    tally.done()
