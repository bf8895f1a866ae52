"""Decode a clip's spatial tiles in batches instead of one decoder call per tile.

diffusers' `AutoencoderKLMiniMaxH3._decode_clip` cuts each latent clip into equal, overlapping
tiles and calls the ViT decoder once per tile: at 768x1344 that is 196 calls of ~1,800 tokens,
whose GEMMs are too small to fill a large GPU. The decoder treats batch entries independently,
so stacking the tiles of a clip yields the same tiles in a few calls; the VAE's own
`_split_tiles` and `_stitch_tiles` lay them out and blend them as before. Opt-in
(`tile_batch > 1`): a GEMM over more rows may round differently on a GPU.
"""

from __future__ import annotations

import functools

import torch


def batch_tiles(vae, tile_batch: int) -> None:
    """Make `vae` decode up to `tile_batch` tiles per decoder call (1: diffusers' own loop)."""
    if tile_batch < 1:
        raise ValueError(f"tile_batch must be at least 1, got {tile_batch}")
    if tile_batch > 1:
        vae._decode_clip = functools.partial(_decode_clip_batched, vae, tile_batch)


def _decode_clip_batched(vae, tile_batch: int, z: torch.Tensor) -> torch.Tensor:
    if not vae.use_tiling:
        return vae.decoder(vae.post_quant_conv(z))
    ratio = vae.spatial_compression_ratio
    ys, heights, y_overlaps = vae._split_tiles(z.shape[-2] * ratio, vae.tile_sample_min_height,
                                               vae.tile_sample_min_overlap_height)
    xs, widths, x_overlaps = vae._split_tiles(z.shape[-1] * ratio, vae.tile_sample_min_width,
                                              vae.tile_sample_min_overlap_width)
    tiles = [z[..., y // ratio: y // ratio + h // ratio, x // ratio: x // ratio + w // ratio]
             for y, h in zip(ys, heights) for x, w in zip(xs, widths)]
    decoded = []
    for start in range(0, len(tiles), tile_batch):
        batch = torch.cat(tiles[start:start + tile_batch])
        decoded.extend(vae.decoder(vae.post_quant_conv(batch)).split(z.shape[0]))
    rows = [decoded[i:i + len(xs)] for i in range(0, len(decoded), len(xs))]
    return vae._stitch_tiles(rows, y_overlaps, x_overlaps)
