"""Config-only dirs for architectures jspec does not support (saved by transformers' config classes)."""
import transformers as T, os
B = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=512)
for name, cls, kw in [("phi3", "Phi3Config", {}), ("mistral", "MistralConfig", dict(sliding_window=8)),
                      ("qwen2", "Qwen2Config", {}), ("gemma2", "Gemma2Config", dict(head_dim=16)),
                      ("qwen2_moe", "Qwen2MoeConfig", {}), ("gemma", "GemmaConfig", dict(head_dim=16)),
                      ("llama4_text", "Llama4TextConfig", {}), ("olmo2", "Olmo2Config", {})]:
    c = getattr(T, cls)(**kw)
    d = f"/tmp/sweep_hf/unsup/{name}"; os.makedirs(d, exist_ok=True); c.save_pretrained(d)
