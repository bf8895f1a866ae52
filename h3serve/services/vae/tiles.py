"""Decode a clip's spatial tiles in batches, and over several GPUs, instead of one decoder call per tile.

diffusers' `AutoencoderKLMiniMaxH3._decode_clip` cuts each latent clip into equal, overlapping
tiles and calls the ViT decoder once per tile: at 768x1344 that is 196 calls of ~1,800 tokens,
whose GEMMs are too small to fill a large GPU. The decoder treats batch entries independently,
so stacking the tiles of a clip yields the same tiles in a few calls (`tile_batch`), and a
replica of the decoder on another GPU can decode a share of them at the same time
(`decode_gpus`); the VAE's own `_split_tiles` and `_stitch_tiles` lay them out and blend them on
the first GPU as before. With `tile_batch = 1` every tile is its own call on every GPU, so the
frames are bit-identical to diffusers' loop on identical GPUs; `tile_batch > 1` is opt-in: a GEMM
over more rows may round differently on a GPU.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import AutoencoderKLMiniMaxH3


@dataclass(frozen=True)
class Replica:
    """The VAE one device decodes tiles with: the service's own on the first device, decoder-only copies on the
    others (their fast path applied like the first's: `TileDecoder.models`)."""

    vae: AutoencoderKLMiniMaxH3
    device: torch.device

    def decode(self, tiles: list[torch.Tensor], tile_batch: int, home: torch.device) -> list[torch.Tensor]:
        decoded = []
        for start in range(0, len(tiles), tile_batch):
            batch = torch.cat(tiles[start : start + tile_batch]).to(self.device)
            decoded.extend(self.vae.decoder(self.vae.post_quant_conv(batch)).to(home).split(tiles[0].shape[0]))
        return decoded


def decode_devices(device: torch.device, count: int) -> list[torch.device]:
    """The GPUs one decode spreads over: `device` and the next `count - 1` this process sees."""
    if count == 1:
        return [device]
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if visible < count:
        raise ValueError(
            f"decode_gpus = {count} spreads the tiles over {count} GPUs; this VAE runs on "
            f"{device} and sees {visible} GPU(s) (its gpus)"
        )
    return [torch.device("cuda", ((device.index or 0) + k) % visible) for k in range(count)]


def _decoder_copy(vae, device: torch.device):
    """`vae` without its encoder, copied to `device`."""
    encoder, vae.encoder = vae.encoder, None
    try:
        return copy.deepcopy(vae).to(device)
    finally:
        vae.encoder = encoder


class TileDecoder:
    """Replaces `vae._decode_clip` when tiles are batched or spread; `decoders` are what progress hooks watch.
    Build it before the fast path, then apply that to every one of `models`."""

    def __init__(self, vae, tile_batch: int = 1, devices: list[torch.device] | None = None) -> None:
        if tile_batch < 1:
            raise ValueError(f"tile_batch must be at least 1, got {tile_batch}")
        self.vae, self.tile_batch = vae, tile_batch
        home = vae.post_quant_conv.weight.device
        self.replicas = [Replica(vae, home)] + [
            Replica(_decoder_copy(vae, device), device) for device in (devices or [home])[1:]
        ]
        if tile_batch > 1 or len(self.replicas) > 1:
            vae._decode_clip = self.decode_clip
        else:
            vars(vae).pop("_decode_clip", None)  # diffusers' own loop (again, after an earlier TileDecoder)
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="tiles")

    @property
    def models(self) -> list[AutoencoderKLMiniMaxH3]:
        return [replica.vae for replica in self.replicas]

    @property
    def decoders(self) -> list[torch.nn.Module]:
        return [replica.vae.decoder for replica in self.replicas]

    def decode_clip(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if not vae.use_tiling:
            return vae.decoder(vae.post_quant_conv(z))
        ratio = vae.spatial_compression_ratio
        ys, heights, y_overlaps = vae._split_tiles(
            z.shape[-2] * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height
        )
        xs, widths, x_overlaps = vae._split_tiles(
            z.shape[-1] * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width
        )
        tiles = [
            z[..., y // ratio : y // ratio + h // ratio, x // ratio : x // ratio + w // ratio]
            for y, h in zip(ys, heights, strict=True)
            for x, w in zip(xs, widths, strict=True)
        ]
        decoded = [tile for share in self._spread(tiles, z.device) for tile in share]
        rows = [decoded[i : i + len(xs)] for i in range(0, len(decoded), len(xs))]
        return vae._stitch_tiles(rows, y_overlaps, x_overlaps)

    def _spread(self, tiles: list[torch.Tensor], home: torch.device) -> list[list[torch.Tensor]]:
        """Consecutive shares of `tiles`, one per replica, decoded at the same time; in tile order."""
        count = len(self.replicas)
        bounds = [len(tiles) * k // count for k in range(count + 1)]
        if count == 1:  # no thread hop for the common case
            return [self.replicas[0].decode(tiles, self.tile_batch, home)]
        futures = [
            self._pool.submit(replica.decode, tiles[bounds[k] : bounds[k + 1]], self.tile_batch, home)
            for k, replica in enumerate(self.replicas)
        ]
        wait(futures)  # every share done, also when one failed: no replica still decodes once this returns
        return [future.result() for future in futures]
