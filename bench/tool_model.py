"""A tiny Qwen3 taught, in a few seconds of plain supervised training, to call the python tool, and
an env that asks for its answer twice (so every episode has four model turns).

A random-init model never writes a tool call, so the multi-turn tests start from one that has
learned a fixed script by heart: set a variable in one call, print it in the next, then answer.
Its demonstrations are built by the same sequence builder as the rollouts, so what it learns is
exactly the token sequence a multi-turn episode is. Made locally; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import contextlib
import io
import time

from envs.code.env import show
from envs.code.python_tool import SCHEMA, PythonTool
from envs.code.sandbox import ExecResult
from envs.code.tasks import load_tasks
from ray_forge.config.schema import TinyModelConfig
from ray_forge.core.chat import ChatFormat
from ray_forge.core.env import StepResult, TextEnv
from ray_forge.core.episode import Turn
from ray_forge.core.sequence import SequenceBuilder
from ray_forge.models.tiny import make_tiny_qwen3

SECRET = "7"
SCRIPT = (
    (f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": f"x = {SECRET}"}})}</tool_call>', "[no output]"),
    (f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": "print(x)"}})}</tool_call>', SECRET),
    ("```python\nprint(7)\n```<|im_end|>", None),
)
"""(what the model writes, what the tool answers) per turn; the last turn is the answer."""
# A model folder's own template, in Qwen3's format and written here, not the tiny model's: Qwen3's
# tool header, JSON calls on lines of their own, and an earlier answer's reasoning dropped once a
# new user query follows (so it rewrites earlier turns, which the sequence builder must notice).
FOLDER_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system{{ '\\n' }}# Tools{{ '\\n' }}{{ '\\n' }}You may call one or more functions to "
    "assist with the user query.{{ '\\n' }}<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{% if loop.index0 > ns.last %}{{ m.content }}{% else %}{{ m.content.split('</think>')[-1] }}{% endif %}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ '\\n' }}{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}{{ '\\n' }}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m.content }}{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
SHAPE = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                        max_position_embeddings=1024, tokenizer="bpe", bpe_vocab_size=512)


def demonstrations(chat: ChatFormat, prompts: list[str]):
    """One (token ids, loss mask) per prompt: the script played through the sequence builder."""
    rows = []
    for prompt in prompts:
        builder = SequenceBuilder(chat, [{"role": "user", "content": prompt}])
        for text, output in SCRIPT:
            ids = tuple(chat.tokenizer.encode(text, add_special_tokens=False))
            builder.add_model_turn(Turn(builder.prompt(), ids, (0.0,) * len(ids), 0, token_versions=(0,) * len(ids)),
                                   chat.decode(ids))
            if output is not None:
                builder.add_env_turn([{"role": "tool", "name": "python", "content": output}])
        [segment] = builder.segments()
        rows.append((segment.token_ids, segment.loss_mask))
    return rows


def make_tool_caller(folder: Path, corpus: list[str], tasks: list | None = None, max_steps: int = 400) -> Path:
    """The tiny chat model in ``folder`` with :data:`FOLDER_TEMPLATE`, trained until it follows the
    script on every one of ``tasks`` (the bundled ones by default)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    make_tiny_qwen3(folder, corpus, SHAPE, chat=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = FOLDER_TEMPLATE  # the folder's own, which the job must use
    tokenizer.save_pretrained(folder)
    chat = ChatFormat(tokenizer, [SCHEMA])
    rows = demonstrations(chat, [show(task, tool=True) for task in tasks or load_tasks()])
    width = max(len(ids) for ids, _ in rows)
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        inputs[r, :len(ids)] = torch.tensor(ids)
        labels[r, :len(ids)] = torch.where(torch.tensor(mask) > 0, torch.tensor(ids), -100)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(max_steps):
        out = model(input_ids=inputs, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 19 and _learned(model, inputs, labels):
            break
    else:
        raise RuntimeError(f"the tool script was not learned in {max_steps} steps")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@torch.no_grad()
def _learned(model, inputs, labels) -> bool:
    """Every scripted token is the greedy choice after its own prefix."""
    logits = model(input_ids=inputs).logits[:, :-1]
    targets = labels[:, 1:]
    picked = targets != -100
    return bool((logits.argmax(-1)[picked] == targets[picked]).all())


class Namespace:
    """An interpreter session in this process, ``latency_s`` slow: the tool's speed is what is
    measured, or nothing at all (the sandbox has tests of its own)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s, self.namespace = latency_s, {}

    def new_session(self) -> None:
        self.namespace = {}

    def execute(self, code: str) -> ExecResult:
        time.sleep(self.latency_s)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, self.namespace)
        return ExecResult(out.getvalue(), "", 0, None, self.latency_s)


class CheckedAnswer(TextEnv):
    """One of the bundled tasks' prompts; the first answer is asked for once more, the second
    ends the episode (reward 1 when it says the secret): with the script, four model turns."""

    action_words = None

    def __init__(self, latency_s: float = 0.0) -> None:
        self.session = Namespace(latency_s)
        self.prompts = [show(task, tool=True) for task in load_tasks()]

    def reset(self, seed: int) -> str:
        self.session.new_session()
        self.answers = 0
        return self.prompts[seed % len(self.prompts)]

    def step(self, text: str) -> StepResult:
        self.answers += 1
        return StepResult("Check it once more.", float(SECRET in text), self.answers == 2)

    def tools(self) -> list:
        return [PythonTool(self.session)]
