"""The fault walk's `dit-fp8-save` victim: the moment the fp8 store's background save has begun (its directory aside
exists), and what the cache holds once the restarted DiT's own save has ended, with how that DiT got its weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.served import wait_for_fp8_save
from bench.walk_stack import Stack, until
from h3serve.runtime import quantised_store

SAVING = "saving"  # the moment of FP8_SAVE: the fp8 save's directory aside exists
PARTIAL = ".partial-"  # the quantised store's directory aside: `<partition>-fp8-<key>.partial-<writer pid>`
SAVE_POLL_S = 0.05  # the kill lands within this of the fp8 save's start


@dataclass(frozen=True)
class SaveAtKill:
    """The fp8 save the kill interrupted, as it was the moment before: its directory aside and the files in it."""

    directory: Path
    files: int


def writer(partial: Path) -> int:
    """The pid of the process that writes (or wrote) a save's directory aside."""
    return int(partial.name.rpartition(PARTIAL)[2])


@dataclass(frozen=True)
class Fp8Aftermath:
    """--fp8-cache once the restarted DiT's own save has ended, and how that DiT got its weights."""

    killed: SaveAtKill
    whole: list[str]  # saved partitions
    partials: list[str]  # directories aside left, each with whose save it was
    restart: list[str]  # the fp8 store's log lines since the kill

    def verdict(self) -> str:
        lines = " ".join(self.restart)
        if "fp8 weights assigned from" in lines:
            return "the restart assigned the weights from the cache"
        if "quantising" in lines:
            saved = "fp8 weights saved to" in lines
            return "the restart quantised again" + (" and saved them whole" if saved else ", saved nothing")
        return "the DiT's log says nothing of a restart's fp8 weights"

    def describe(self) -> str:
        return (
            f"killed while {self.killed.directory.name} held {self.killed.files} file(s); after: "
            f"{len(self.whole)} whole ({', '.join(self.whole) or 'none'}), "
            f"{'; '.join(self.partials) or f'no {PARTIAL} left'}; {self.verdict()}"
        )


def wait_for_save(cache: Path, limit_s: float) -> SaveAtKill:
    """The fp8 save's directory aside once it exists, and the files in it then; refused when the save has already
    ended: only a DiT whose weights stay on the GPU, unsharded, saves in the background while it serves (with FSDP or
    group offload it saves before it turns SERVING)."""

    def saving() -> Path | None:
        partials = sorted(cache.glob(f"*{PARTIAL}*"))
        if not partials and whole(cache):
            raise SystemExit(
                f"bench.fault_walk: the fp8 save into {cache} had ended ({', '.join(whole(cache))}) by the time the "
                "jobs were acknowledged: no save left to kill (FSDP and group offload save before the DiT serves)"
            )
        return partials[0] if partials else None

    partial = until(saving, limit_s, f"the fp8 save to begin in {cache}", poll_s=SAVE_POLL_S)
    if partial is None:
        raise RuntimeError(f"no fp8 save began in {cache} within {limit_s:.0f} s")
    return SaveAtKill(partial, len(list(partial.iterdir())))


def whole(cache: Path) -> list[str]:
    """The partitions saved whole in the fp8 cache."""
    return sorted(p.name for p in cache.iterdir() if PARTIAL not in p.name) if cache.is_dir() else []


def fp8_aftermath(stack: Stack, cache: Path, killed: SaveAtKill, log_from: int) -> Fp8Aftermath:
    """The cache once no save is in flight (the restarted DiT's own, which a stop would cut), and what the fp8 store
    logged since the kill (`log_from`: the DiT log's size then)."""
    wait_for_fp8_save(str(cache))
    running, partials = quantised_store.saves_in_flight(cache), []
    for partial in sorted(cache.glob(f"*{PARTIAL}*")):
        whose = "the killed rank 0's" if writer(partial) == writer(killed.directory) else f"pid {writer(partial)}'s"
        partials.append(f"{partial.name} ({whose}, {'still writing' if partial in running else 'its writer dead'})")
    with open(stack.dit_log(), "rb") as log:
        log.seek(log_from)
        lines = log.read().decode(errors="replace").splitlines()
    restart = [line.partition("h3serve.quantised_store: ")[2] for line in lines if "h3serve.quantised_store: " in line]
    return Fp8Aftermath(killed, whole(cache), partials, restart)
