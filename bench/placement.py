"""Where bench.e2e puts the encoder, the DiT group and the VAE on the N GPUs of one host.

Memory per process at 768x1344x124 in bf16 (docs/deploy/h200x4.toml, docs/deploy/sharded-dit.md, the shared
notes): a DiT rank holds the 61.7 GiB transformer when replicated (68.3 GiB peak on one GPU, ~66 GiB per rank
with Ulysses 2, a little less with 4), or 1/N of it plus the block being run with FSDP2 (~38 GiB per rank at
N = 2); the text encoder (Qwen3-VL-32B cut to the 51 layers the pipeline reads) ~49 GiB; the VAEs ~6 GiB plus
the tiled decode's 7.8 GiB peak. An H200 has ~139 GiB, and all four on one GPU used 128.5 GiB at 480x832.

Two placements:
- `shared` (the default; one request's latency, the way SGLang's 74.38 s runs Ulysses over all 4 GPUs): the
  DiT group spans all N GPUs; the encoder shares GPU 0 with rank 0 (~49 + 66 GiB) and the VAE shares GPU N-1
  with the last rank (~14 + 66 GiB), so no GPU nears its limit even with the DiT replicated. N = 1 is every
  service on the one device.
- `dedicated` (docs/deploy/h200x4.toml for N = 4: encoder GPU 0, DiT GPUs 1..N-2, VAE GPU N-1): every stage
  owns its GPUs, so jobs pipeline across stages (throughput); one request's denoise runs on N-2 GPUs only.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("shared", "dedicated")


def gpu_list(first: int, last: int) -> str:
    """CUDA_VISIBLE_DEVICES for GPUs first..last."""
    return ",".join(str(i) for i in range(first, last + 1))


@dataclass(frozen=True)
class Placement:
    """Each service's GPUs (CUDA_VISIBLE_DEVICES; empty: inherit, i.e. one device or the CPU) and the DiT group."""

    gpus: int  # GPUs of the host the services use
    encoder: str
    dit: str
    vae: str
    world_size: int  # DiT ranks, one per GPU in `dit` (on CPU: gloo ranks)
    fsdp: bool

    @classmethod
    def plan(cls, gpus: int, kind: str = "shared", fsdp: bool = False, cuda: bool = True) -> Placement:
        """`kind` over `gpus` GPUs; `cuda=False` keeps the ranks but sets no CUDA_VISIBLE_DEVICES (CPU test)."""
        if gpus < 1:
            raise ValueError(f"--gpus must be at least 1, got {gpus}")
        if kind not in PLACEMENTS:
            raise ValueError(f"placement {kind!r}: choose one of {', '.join(PLACEMENTS)}")
        if gpus == 1:
            return cls(1, "", "", "", 1, fsdp)
        if kind == "dedicated" and gpus < 3:
            raise ValueError(f"placement 'dedicated' needs at least 3 GPUs (encoder, DiT, VAE), got {gpus}")
        first, last = (1, gpus - 2) if kind == "dedicated" else (0, gpus - 1)
        encoder, dit, vae = "0", gpu_list(first, last), str(gpus - 1)
        if not cuda:
            encoder = dit = vae = ""
        return cls(gpus, encoder, dit, vae, last - first + 1, fsdp)

    def describe(self) -> str:
        """For the records: which GPUs each service had and how the DiT split its work."""
        weights = "FSDP2" if self.fsdp else "replicated"
        if self.gpus == 1:
            return "one device" + (", DiT FSDP2" if self.fsdp else "")
        if not self.dit:
            return f"CPU; DiT {self.world_size} gloo ranks (Ulysses {self.world_size}, {weights})"
        return (
            f"{self.gpus} GPUs; encoder GPU {self.encoder}, DiT Ulysses {self.world_size} on GPUs {self.dit} "
            f"({weights}), VAE GPU {self.vae}"
        )
