"""Small helpers shared by tests."""

from __future__ import annotations

import torch


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def cpu_kernels() -> str:
    """The CPU kernel family torch dispatches to here ("AVX2", "AVX512", ...), "+AMX" where the CPU
    has AMX tiles. Some golden bits depend on it (bf16 drafts, fp32 log-probabilities), so those are
    recorded per family. An AVX512 machine with AMX moved fp32 bits that AVX2 kept, and one greedy
    token of the engine's golden file (a 0.14-nat choice); the BLAS and oneDNN ISA caps
    (MKL_ENABLE_INSTRUCTIONS, MKL_CBWR, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) did not bring them
    back, so AMX marks the family rather than being shown to cause it."""
    family = torch.backends.cpu.get_cpu_capability()
    return family + "+AMX" if "amx_tile" in _cpu_flags() else family


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:  # not Linux: no family suffix
        return set()


def for_cpu(doc: dict, by_cpu: str, main: object, kernels: str) -> object | None:
    """The part of golden file ``doc`` recorded for CPU kernel family ``kernels``: ``doc[by_cpu]
    [kernels]`` where a tool added one, else ``main`` (the file's own record) where the file's family
    is ``kernels`` or was not recorded (files made before families were), else None."""
    if kernels in doc.get(by_cpu, {}):
        return doc[by_cpu][kernels]
    return main if doc["environment"].get("cpu_kernels") in (None, kernels) else None
