"""The host's CPU flags decide the fast dtype: bfloat16 only with native bf16 arithmetic."""

from __future__ import annotations

from cluster.engine.kernels.cpu_isa import fast_dtype, isa, native_bf16, parse_cpuinfo

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx fma avx2 bmi2
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx2 avx512f avx512bw\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"


def test_cpuinfo_gives_the_first_processors_model_and_flags() -> None:
    model, flags = parse_cpuinfo(EPYC_AVX2)
    assert model == "AMD EPYC 7B13"
    assert flags == {"fpu", "sse4_2", "avx", "fma", "avx2", "bmi2"}
    assert parse_cpuinfo(GRAVITON3) == ("unknown CPU", {"fp", "asimd", "sve", "bf16", "i8mm"})
    assert parse_cpuinfo("") == ("unknown CPU", frozenset())


def test_bfloat16_is_the_fast_dtype_only_with_native_bf16() -> None:
    for text, native in [(EPYC_AVX2, False), (SKYLAKE, False), (SAPPHIRE_RAPIDS, True),
                         (GRAVITON3, True)]:  # fmt: skip
        flags = parse_cpuinfo(text)[1]
        assert native_bf16(flags) is native
        assert fast_dtype("cpu", flags) == ("bfloat16" if native else "float32")
        assert fast_dtype("cuda", flags) == "bfloat16"


def test_isa_names_the_wide_extensions_or_the_best_narrow_one() -> None:
    assert (
        isa(parse_cpuinfo(SAPPHIRE_RAPIDS)[1]) == "amx_bf16 amx_tile avx512_bf16 avx512bw avx512f"
    )
    assert isa(parse_cpuinfo(EPYC_AVX2)[1]) == "avx2 (no AVX-512)"
    assert isa(parse_cpuinfo(GRAVITON3)[1]) == "asimd"
    assert isa(frozenset()) == "no SIMD flag"
