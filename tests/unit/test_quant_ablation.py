"""benchmarks/quant_ablation.py on a tiny model: the engine runs each setting, the table has one
row per setting, and bits per element (overhead included) fall with the width."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import quant_ablation as qa  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # head_dim 32 and 2 KV heads: small, but per-channel blocks and outliers behave as on
    # the shipped model
    return build_tiny_model(str(tmp_path_factory.mktemp("abl")), "qwen3", seed=2,
                            max_position_embeddings=4096)


def test_settings_order_and_parts():
    names = [s.name for s in qa.ablation_settings((4, 2))]
    assert names[:4] == ["float32", "int8", "fp8_e4m3", "fp8_e5m2"]
    assert names[4] == "4-bit uniform per-token" and names[9] == "4-bit + sinks"
    full = qa.ablation_settings((3,), (), ("+ sinks",))[0]
    assert full.parts == qa.PARTS and full.outlier_fraction == 0.01 and full.num_sinks == 1
    with pytest.raises(ValueError):
        qa.ablation_settings((5,))
    with pytest.raises(ValueError):
        qa.ablation_settings((4,), ("bf16",))


def test_ablation_rows_and_bits_per_element(model, tmp_path):
    settings = (qa.ablation_settings((4, 2), ("float32", "int8"), ("uniform per-token",))
                + qa.ablation_settings((2,), (), ("+ nuq", "+ sinks")))
    rows = qa.run_ablation(model, settings, context_tokens=256, ppl_windows=1,
                           passkey_samples=1, block_size=16, max_num_seqs=2, calib_samples=2,
                           calib_seq_len=64, kmeans_iters=3, work_dir=str(tmp_path / "work"),
                           log=lambda s: None)
    assert [r.setting for r in rows] == [s.name for s in settings]
    bpe = {r.setting: r.bits_per_element for r in rows}
    # 2 x 2 layers x 2 KV heads x 32 = 256 elements per token: the 4-byte slot position is 1/8 bit
    assert bpe["float32"] == pytest.approx(32.125)
    assert bpe["int8"] == pytest.approx(9.125)  # + a float32 scale per token and head: 1 bit
    assert bpe["int8"] > bpe["4-bit uniform per-token"] > bpe["2-bit uniform per-token"]
    assert bpe["4-bit uniform per-token"] == pytest.approx(5.125, abs=0.01)  # fp16 offset + half
    # outliers and sinks cost bits; nuq (a codebook per layer) almost none
    assert bpe["2-bit + sinks"] > bpe["2-bit + nuq"]
    ref = rows[0]
    assert ref.delta == 0 and ref.kl == 0 and ref.top1 == 1
    for r in rows:
        assert r.perplexity > 1 and r.passkey is not None and 0 <= r.passkey <= 1
        assert r.kl is not None and r.kl >= -1e-6
    # the nuq setting really ran with codebooks, through the engine's calibration file
    files = {p.name: json.loads(p.read_text()) for p in (tmp_path / "work").glob("*.json")}
    nuq = files["calib_2bit_per_channel_keys-pre_rope_keys-nuq.json"]
    assert nuq["settings"]["nuq"] and len(nuq["codebooks"]["2"]["keys"][0]) == 4
    base = files["calib_2bit_none.json"]
    assert not base["settings"]["per_channel_keys"] and not base["settings"]["pre_rope_keys"]
    assert base["settings"]["outlier_fraction"] == 0 and base["settings"]["num_sink_tokens"] == 0
    # the Markdown table has a header, a rule and one line per setting
    table = qa.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[0].startswith("| setting |")
    assert all(line.count("|") == table[0].count("|") for line in table)
    meta = {"model": model, "context_tokens": 256, "ppl_windows": 1, "context_fraction": 0.75,
            "passkey_samples": 1, "block_size": 16, "num_layers": 2, "num_kv_heads": 2,
            "head_dim": 32, "calib_tokens": 128, "seconds": 1.0, "host": "test"}
    qa.write_results(rows, tmp_path / "out", "cmd", meta)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"ablation.md", "ablation.json",
                                                              "ablation.png"}


def test_pre_rope_switch_reaches_the_store(model, tmp_path):
    """The calibration file's settings.pre_rope_keys (the ablation switch) reaches the store."""
    from nanokv import LLM

    setting = qa.ablation_settings((4,), (), ("+ per-channel keys",))[0]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(qa.calibration_json(setting, qa._dims(model), model, 16, {},
                                                   1.0, 0)))
    llm = LLM(model, kv_cache_dtype="kvquant", kv_quant_bits=4, kv_quant_config=str(path),
              block_size=16, max_model_len=128, max_num_seqs=2, num_kv_blocks=16,
              dtype="float32")
    store = llm.engine.kv_cache
    assert store.pre_rope_keys is False and store.config.per_channel_keys is True
    assert store.config.outlier_fraction == 0 and store.config.num_sink_tokens == 0
