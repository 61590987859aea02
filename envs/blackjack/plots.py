"""The learned BlackJack decision table beside the optimal one, disagreements marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from envs.blackjack.env import DEFAULT_PENALTY, State
from envs.blackjack.exact import DEALER_CARDS, agreement, evaluate_table, optimal_table
from ray_forge.observe.plots import figure, learning_curve_png, save

HARD_SUMS, SOFT_SUMS = range(4, 22), range(12, 22)  # a soft hand is 12 at least
INVALID = 2.0
"""A cell's value when the answer could not be read (HIT is 1, STICK 0)."""


def _state(key: str) -> State:
    """'14/10/hard' (``policy_eval.state_key``) back into a State."""
    player, dealer, kind = key.split("/")
    return State(int(player), int(dealer), kind == "soft")


def _table_from_decisions(decisions: dict[str, int]) -> dict[State, float]:
    """``evaluate()``'s ``decisions`` ('14/10/hard' -> 1 for HIT) back into a table."""
    return {_state(key): float(hit) for key, hit in decisions.items()}


def _grid(table: dict[State, float], sums: range, soft: bool) -> np.ndarray:
    return np.array([[table[State(p, d, soft)] for d in DEALER_CARDS] for p in sums])


def decision_table_png(decisions: dict[str, int], path: str | Path, title: str = "",
                       invalid_states: list[str] = (), penalty: float = DEFAULT_PENALTY) -> Path:
    """Rows: hard and soft hands; columns: the learned table, the optimal one. Each cell is the
    action in that state (player sum x dealer's card); red frames mark disagreements, grey "?"
    cells answers the env could not read (valued at ``penalty``, as in ``evaluate``)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    learned, optimal = _table_from_decisions(decisions), optimal_table()
    invalid = {_state(key) for key in invalid_states}
    for state in invalid:
        learned[state] = INVALID
    fig = figure((12.0, 10.0))
    axes = fig.subplots(2, 2, height_ratios=(len(HARD_SUMS), len(SOFT_SUMS)))
    colours = ListedColormap(["#4c72b0", "#dd8452", "#8c8c8c"])  # STICK, HIT, unreadable
    for row, (soft, sums) in enumerate(((False, HARD_SUMS), (True, SOFT_SUMS))):
        mine, best = _grid(learned, sums, soft), _grid(optimal, sums, soft)
        for col, (grid, name) in enumerate(((mine, "learned"), (best, "optimal"))):
            ax = axes[row, col]
            ax.imshow(grid, cmap=colours, vmin=0, vmax=INVALID, origin="lower", aspect="auto")
            for i, j in np.ndindex(grid.shape):
                label = "?" if grid[i, j] == INVALID else "H" if grid[i, j] >= 0.5 else "S"
                ax.text(j, i, label, ha="center", va="center", fontsize=8, color="white")
                if col == 0 and (grid[i, j] == INVALID or (grid[i, j] >= 0.5) != (best[i, j] >= 0.5)):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2.5))
            ax.set_xticks(range(len(DEALER_CARDS)), ["A" if d == 1 else str(d) for d in DEALER_CARDS])
            ax.set_yticks(range(len(sums)), [str(s) for s in sums])
            ax.set_xlabel("dealer shows")
            ax.set_ylabel(f"player sum ({'soft' if soft else 'hard'})")
            ax.set_title(f"{name}, {'soft' if soft else 'hard'} hands")
    wrong = sum(s in invalid or (learned[s] >= 0.5) != (optimal[s] >= 0.5) for s in optimal)
    fig.legend(handles=[Patch(color="#dd8452", label="HIT"), Patch(color="#4c72b0", label="STICK"),
                        Patch(color="#8c8c8c", label=f"unreadable answer ({len(invalid)} states)"),
                        Patch(fill=False, ec="red", lw=2.5, label=f"differs from optimal ({wrong} states)")],
               loc="outside lower center", ncols=4)
    learned = {s: (0.0 if s in invalid else v) for s, v in learned.items()}
    value, agree = evaluate_table(learned, invalid, penalty), agreement(learned, optimal, invalid)
    fig.suptitle(title or (f"decision table: return {value:+.4f} "
                           f"(optimal {evaluate_table(optimal):+.4f}), agreement {agree:.3f} (reach-weighted)"))
    return save(fig, path)


def reference_returns() -> dict[str, float]:
    """Exact returns of the optimal, the best dealer-blind and the always-STICK policies."""
    from envs.blackjack.exact import all_states

    # The best policy that ignores the dealer's card: the ceiling of the public demo's prompt.
    dealer_blind = {s: float(s.player_sum < (18 if s.usable_ace else 15)) for s in all_states()}
    return {"optimal policy (exact)": evaluate_table(optimal_table()),
            "best dealer-blind policy (exact)": evaluate_table(dealer_blind),
            "always STICK (exact)": evaluate_table({s: 0.0 for s in all_states()})}


def run_pictures(run_dir: str | Path, rows: list[dict], final: dict) -> list[Path]:
    """The PNGs a BlackJack run ends with: its learning curve and its final decision table
    (``final`` is ``policy_eval.evaluate``'s result)."""
    run_dir = Path(run_dir)
    agreement = ("eval_agreement", "agreement with optimal\n(reach-weighted)", (0, 1))
    return [learning_curve_png(rows, run_dir / "learning_curve.png", "BlackJack GRPO", reference_returns(), agreement),
            decision_table_png(final["decisions"], run_dir / "decision_table.png",
                               invalid_states=final.get("invalid_states", ()),
                               penalty=final.get("invalid_action_penalty", DEFAULT_PENALTY))]
