"""GGUF loading through lit_rl.models.load_causal_lm, with a tiny Llama written as an F32 GGUF in the test.

Nothing is downloaded: a random two-layer Llama from ``lit_rl.models.tiny.tiny_model`` is written with
``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama (same metadata keys,
same tensor names, q/k rows permuted), read back by transformers' GGUF loader, and compared logit for logit.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from lit_rl.models import load_causal_lm
from lit_rl.models.tiny import tiny_model

gguf = pytest.importorskip("gguf")

VOCAB = 96


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``).

    Inverse of transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_llama_gguf(model, path) -> None:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("lit-rl-tiny-llama")  # general.name; transformers treats "mistral" in it as Mistral
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i in range(cfg.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = _permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                w = _permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
            tensors[f"blk.{i}.{gguf_name}.weight"] = w
    for name, w in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_permute_is_inverse_of_transformers_reverse_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor()
    q = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)  # 4 heads x head_dim 8
    k = q[:16]  # 2 kv heads x head_dim 8
    for w, n_kv in [(q, 4), (k, 2)]:
        assert not np.array_equal(_permute(w, 4, n_kv), w)
        np.testing.assert_array_equal(proc._reverse_permute_weights(_permute(w, 4, n_kv), 4, n_kv), w)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_gguf_file_and_folder_match_original(tmp_path, tied):
    ref = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, tie_word_embeddings=tied).eval()
    path = tmp_path / "tiny-llama-f32.gguf"
    _write_llama_gguf(ref, path)

    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits

    by_file = load_causal_lm(str(path))
    by_folder = load_causal_lm(str(tmp_path), gguf_file=path.name)
    for loaded in (by_file, by_folder):
        cfg = loaded.config
        assert cfg.model_type == "llama"
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (VOCAB, 32, 2)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
        assert cfg.tie_word_embeddings == tied
        assert next(loaded.parameters()).dtype == torch.float32
        if tied:
            assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        loaded.eval()
        with torch.no_grad():
            got = loaded(ids).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # a model loaded from GGUF is plain float weights: it can be fine-tuned and exported
    by_file.save_pretrained(tmp_path / "exported")
    assert (tmp_path / "exported" / "model.safetensors").exists()


def test_missing_gguf_file_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_causal_lm(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_causal_lm(str(tmp_path), gguf_file="nope.gguf")


def test_gguf_without_gguf_package_names_pip_install(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # never read: the package check comes first
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "gguf" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="pip install gguf"):
        load_causal_lm(str(path))
    with pytest.raises(ImportError, match="pip install gguf"):
        load_causal_lm(str(tmp_path), gguf_file=path.name)
