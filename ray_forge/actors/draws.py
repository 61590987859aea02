"""One-token answers drawn in the policy actor from the engine's distribution
(``policy.draw_from_distribution``): one request per distinct prompt asks the engine for its whole
(processed) distribution over the action tokens, and the prompt's ``n`` samples are drawn from it.

The engine actor (``ray_forge/actors/policy.py``) asks an :class:`EngineSamples` or, when the run
draws and a call asks for one-token answers, a :class:`DistributionDraws` for the same three things:
each request's sampling fields, how the requests reach the step loop, and the answers of each."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import Protocol

import torch

from ray_forge.actors.engine_loop import EngineLoop, token_versions
from ray_forge.config import ConfigError
from ray_forge.core.episode import Answer

TEXT_CACHE = 1 << 16
"""Prompt encodings and one-token answer texts an engine remembers."""

MAX_LOGPROBS = 20
"""vLLM returns at most this many logprobs per token (its ``max_logprobs``)."""

Requests = list[tuple[list[int], object]]
"""(prompt ids, ``SamplingParams``) of each distinct prompt of a call."""


class AnswerSource(Protocol):
    """How one call's distinct prompts become requests of the step loop and answers."""

    def sampling(self, count: int, greedy: bool, seed: int | None) -> dict:
        """``SamplingParams`` fields of a prompt asked ``count`` times (``seed``: its own, or None)."""

    def submit(self, requests: Requests, priority: int) -> tuple[list[Future], list[Future]]:
        """(every request's future, those this call submitted: aborted when it gives up)."""

    def answers(self, index: int, output, count: int, seed: int | None, greedy: bool) -> list[Answer]:
        """The ``count`` answers of the call's ``index``-th distinct prompt, from the engine's ``output``."""


class EngineSamples:
    """The engine samples every answer itself: a request with ``n`` samples per distinct prompt."""

    def __init__(self, loop: EngineLoop, temperature: float) -> None:
        self.loop, self.temperature = loop, temperature

    def sampling(self, count: int, greedy: bool, seed: int | None) -> dict:
        return dict(n=1 if greedy else count, temperature=0.0 if greedy else self.temperature, logprobs=0,
                    seed=None if greedy else seed)

    def submit(self, requests: Requests, priority: int) -> tuple[list[Future], list[Future]]:
        own = self.loop.submit(requests, priority)
        return own, own

    def answers(self, index: int, output, count: int, seed: int | None, greedy: bool) -> list[Answer]:
        return [_answer(index, sample) for sample in output.outputs]


class DistributionDraws:
    """Answers drawn from the distribution the engine computed for each prompt, each request shared
    by the calls that ask for the same prompt while it waits and kept until the weights change."""

    def __init__(self, loop: EngineLoop, allowed_ids: list[int], temperature: float, tokenizer) -> None:
        if len(allowed_ids) > MAX_LOGPROBS:
            raise ConfigError(f"policy.draw_from_distribution=true needs the engine's logprobs of every action token; "
                              f"vLLM returns at most {MAX_LOGPROBS} and this env has {len(allowed_ids)}: set "
                              "policy.draw_from_distribution=false")
        self.loop, self.allowed_ids, self.temperature, self.tokenizer = loop, allowed_ids, temperature, tokenizer
        # One-token answers come in few texts: decoded once each, not once per decision.
        self._answer_text = functools.lru_cache(maxsize=TEXT_CACHE)(self._decode_after)
        self._in_flight: dict[tuple, Future] = {}
        """Waiting distribution requests by (prompt, priority): see ``submit``."""
        self._known: dict[tuple, Future] = {}
        """Finished distribution requests by prompt, all of ``_known_version``: see ``submit``."""
        self._known_version = loop.version
        self._lock = threading.Lock()

    def serves(self, keys) -> bool:
        """Whether a call's (prompt, max tokens) ``keys`` are all one-token answers, which it draws."""
        return all(m == 1 for _, m in keys)

    def sampling(self, count: int, greedy: bool, seed: int | None) -> dict:
        # Greedy draws take the argmax of the same distribution the rollouts draw from, which needs
        # the probability of every allowed token; the engine's own sample is not used, and the
        # request may serve other calls.
        return dict(n=1, temperature=self.temperature, logprobs=len(self.allowed_ids), seed=None)

    def submit(self, requests: Requests, priority: int) -> tuple[list[Future], list[Future]]:
        """Futures of the distributions of ``requests``, each shared with every call that
        asks for the same prompt while its request is waiting, and kept for later calls until the
        engine loads other weights: rollout calls (every turn of a batch's games, its chunks, the
        next batch) ask for mostly the same few states, and each request costs the engine about as
        much as its forward. A kept distribution is the one the engine would compute again (the same
        weights, whose version its answers carry). Returns (every request's future, those this call
        submitted)."""
        with self._lock:
            known = self._known if self._known_version == self.loop.version else {}
            futures = [known.get(tuple(p)) or self._in_flight.get((tuple(p), priority)) for p, _ in requests]
            new = [r for r, f in zip(requests, futures) if f is None]
            own = self.loop.submit(new, priority) if new else []
            submitted = iter(own)
            futures = [f if f is not None else next(submitted) for f in futures]
            for (prompt, _), future in zip(new, own):
                key = (tuple(prompt), priority)
                self._in_flight[key] = future
                future.add_done_callback(lambda done, key=key: self._finished(key, done))
        return futures, own

    def _finished(self, key: tuple, future: Future) -> None:
        """A request is done: its distribution is kept while the engine holds the weights that
        computed it (the version its token carries)."""
        with self._lock:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]
            if future.cancelled() or future.exception() is not None:
                return
            [version] = token_versions(future.result().outputs[0])
            if version != self._known_version:
                self._known, self._known_version = {}, version
            if len(self._known) < TEXT_CACHE:
                self._known[key[0]] = future

    def answers(self, index: int, output, count: int, seed: int | None, greedy: bool) -> list[Answer]:
        return self._draw(index, tuple(output.prompt_token_ids), output.outputs[0], count, seed, greedy)

    def _draw(self, index: int, prompt_ids: tuple[int, ...], sample, n: int, seed: int | None,
              greedy: bool = False) -> list[Answer]:
        """``n`` one-token answers drawn from the distribution the engine computed for this prompt
        (its processed logprobs: after the action restriction and the temperature), each with the
        engine's logprob of the token drawn, as vLLM's sampler would have returned them. ``greedy``:
        its most likely token (the lowest id of a tie, as vLLM's and the trainer's argmax), so an
        evaluation or a sync check costs no request where a rollout has asked for that prompt."""
        [step] = sample.logprobs
        ids = sorted(t for t in step if t in self.allowed_ids)
        if len(ids) != len(self.allowed_ids):
            raise RuntimeError(f"the engine returned logprobs for {sorted(step)}, not for every allowed token "
                               f"{self.allowed_ids}: cannot draw from its distribution")
        logprobs = torch.tensor([step[t].logprob for t in ids], dtype=torch.float64)
        if greedy:
            picks = [int(torch.argmax(logprobs))] * n
        else:
            generator = torch.Generator()
            generator.manual_seed(seed) if seed is not None else generator.seed()
            picks = torch.multinomial(logprobs.exp(), n, replacement=True, generator=generator).tolist()
        [version] = token_versions(sample)
        answers = {k: (index, (ids[k],), (float(logprobs[k]),), (version,), self._answer_text(prompt_ids, ids[k]))
                   for k in set(picks)}
        return [answers[k] for k in picks]  # one tuple per token drawn, shared by the answers that drew it

    def _decode_after(self, prompt_ids: tuple[int, ...], token: int) -> str:
        """The text as vLLM's detokenizer gives it: what ``token`` adds after the prompt (a
        word-level tokenizer puts a space before it)."""
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        return self.tokenizer.decode(prompt_ids + (token,), skip_special_tokens=True)[len(prompt_text):]


def _answer(index: int, sample) -> Answer:
    """One sampled completion of the call's ``index``-th distinct prompt, with the policy version
    of each of its tokens."""
    return (index, tuple(sample.token_ids),
            tuple(step[tok].logprob for step, tok in zip(sample.logprobs, sample.token_ids)),
            token_versions(sample), sample.text)
