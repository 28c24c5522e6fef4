"""Task drawing shared by the env modules; imports nothing heavy (env worker processes load the envs)."""
import random


def seeded_cycle(items, seed, n):
    """n items of seeded shuffles, one pass after another (a pass is a full reshuffle), so n may exceed
    len(items): Stage 2 plays thousands of task instances of a train set that may be smaller."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        batch = list(items)
        rng.shuffle(batch)
        out += batch[:n - len(out)]
    return out
