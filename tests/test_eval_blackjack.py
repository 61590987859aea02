"""Constrained evaluation with a tokenizer in which an action word is several tokens (as Qwen's
"STICK" is): the real vLLM engine answers with whole action words through structured outputs,
and ``jobs/eval_blackjack.py`` scores such a model."""

import pytest
import torch

from envs.blackjack import ACTION_WORDS, BlackjackTextEnv, evaluate_table, render_state
from envs.blackjack.exact import all_states
from envs.blackjack.policy_eval import state_key
from ray_forge.actors.policy import VLLMPolicy, action_token_ids
from ray_forge.config.schema import TinyModelConfig
import tiny_configs

pytestmark = pytest.mark.vllm

BPE_VOCAB = 267
"""Merges enough for "HIT" to be one token but not "STICK" ("ST" + "ICK")."""


def _prefix_tokens(tokenizer, word: str) -> list[int]:
    """Tokens that may start ``word`` (a grammar over the whole word allows any of them first)."""
    return [i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and word.startswith(text)]


@pytest.fixture(scope="module")
def multi_token_model(tmp_path_factory):
    """A tiny Qwen3 whose BPE tokenizer spells STICK in several tokens, with its output layer set
    so that it prefers HIT in about half of the states and a start of STICK in the others.

    Returns the folder, the states in which the model prefers HIT, and the states where that
    preference is clear. A random tiny model answers the same in every state; here every token
    that starts HIT has the logit ``scale * v . h`` and every token that starts STICK
    ``-scale * v . h``, with ``v`` the main direction in which the final hidden states ``h`` of
    the 360 prompts differ, taken orthogonal to their mean."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_forge.models.tiny import make_tiny_qwen3

    folder = make_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny_qwen3_bpe", BlackjackTextEnv.corpus(),
                             TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                                             num_kv_heads=1, head_dim=32, tokenizer="bpe", bpe_vocab_size=BPE_VOCAB))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) > 1 for w in ("STICK", " STICK"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    states = all_states()
    hidden = _last_hidden(model, tokenizer, [render_state(s) for s in states])  # [360, H]
    mean = hidden.mean(0)
    direction = torch.linalg.svd(hidden - mean, full_matrices=False).Vh[0]
    direction -= (direction @ mean) / (mean @ mean) * mean
    direction /= direction.norm()
    weights = load_file(str(folder / "model.safetensors"))
    lm_head = weights["lm_head.weight"]  # [vocab, H]; untied, so the embeddings stay as they are
    scale = 50.0
    for word, sign in (("HIT", 1.0), ("STICK", -1.0)):
        for token in _prefix_tokens(tokenizer, word):
            lm_head[token] = sign * scale * direction
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    margins = (hidden - mean) @ direction
    prefers_hit = {s for s, m in zip(states, margins.tolist()) if m > 0}
    # Near-ties may go either way in another engine's arithmetic; the rest must match.
    clear = {s for s, m in zip(states, margins.tolist()) if abs(m) > 1e-3}
    assert 60 < len(prefers_hit) < 300 and len(clear) > 350
    return folder, prefers_hit, clear


def _last_hidden(model, tokenizer, prompts: list[str]) -> torch.Tensor:
    """[B, H] final hidden state at each prompt's last token, in one right-padded batch (causal
    attention: a prompt's last token never sees the padding after it)."""
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), tokenizer.pad_token_id)  # [B, T]
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    with torch.no_grad():
        return model.model(ids).last_hidden_state[torch.arange(len(rows)), lengths - 1]


@pytest.fixture(scope="module")
def constrained(multi_token_model):
    folder, _, _ = multi_token_model
    engine = VLLMPolicy(tiny_configs.policy(kv_cache_mb=64), model_dir=str(folder), action_words=ACTION_WORDS)
    yield engine
    engine.shutdown()


def test_action_token_ids_is_none_unless_every_word_is_one_token(multi_token_model, tiny_model_dir):
    from transformers import AutoTokenizer

    folder, _, _ = multi_token_model
    assert action_token_ids(AutoTokenizer.from_pretrained(folder), ACTION_WORDS) is None
    word_level = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert action_token_ids(word_level, ACTION_WORDS) == sorted(word_level.convert_tokens_to_ids(list(ACTION_WORDS)))


def test_greedy_answers_are_whole_action_words(constrained, multi_token_model):
    _, prefers_hit, clear = multi_token_model
    assert constrained.get_allowed_token_ids() is None  # the trainer gets no single-token mask
    states = all_states()
    out = constrained.generate([render_state(s) for s in states], greedy=True)
    assert {c.text for c in out} == {"HIT", "STICK"}
    assert max(len(c.response_ids) for c in out if c.text == "STICK") > 1
    # The engine chose the word the model prefers, not merely some word.
    assert {s for s, c in zip(states, out) if c.text == "HIT"} & clear == prefers_hit & clear


def test_sampled_rollouts_with_multi_token_words_fail_with_the_fix(constrained):
    with pytest.raises(ValueError, match="policy.constrain_to_actions=false"):
        constrained.generate([render_state(all_states()[0])])


def test_eval_job_scores_a_multi_token_model(multi_token_model):

    from jobs import eval_blackjack

    folder, prefers_hit, clear = multi_token_model
    result = eval_blackjack.main(["--policy", str(folder), "--mc-games", "300"])
    assert result["invalid_answers"] == 0 and result["invalid_rate"] == 0.0 and result["invalid_action_penalty"] == -1.0
    hits = {s for s in all_states() if result["decisions"][state_key(s)] == 1}
    assert hits & clear == prefers_hit & clear
    assert result["exact_return"] == pytest.approx(evaluate_table({s: float(s in hits) for s in all_states()}))
    assert abs(result["mc_return"] - result["exact_return"]) < 4 * result["mc_stderr"]
