"""A deterministic stand-in game for the rollout-loop tests (the pool imports it in its workers as
`tests.fake_games:make_game`; light imports only, so a worker starts in well under a second).

The spec (a task dict) scripts it: `name`; `win_at` (the step that wins, else never); `delay` (seconds each
step sleeps, so episodes answer in another order than they were sent); `hang_at` (the step that sleeps 60 s:
a hung worker); `raise_at` (the step that raises: a broken game). Observations depend only on the spec and
the step, never on the process, so the same episode gives the same prompts in any worker.
"""
import time


class EchoGame:
    def __init__(self, spec):
        self.spec, self.t = spec, 0

    def state(self, observation, won=False):
        return {"observation": observation, "admissible": ["look", "go north", "go south"], "won": won,
                "done": won, "score": float(won)}

    def reset(self):
        return dict(self.state(f"You are in room {self.spec['name']}. Your task is to: find the exit."),
                    task="find the exit.")

    def step(self, action):
        self.t += 1
        time.sleep(self.spec.get("delay", 0.0))
        if self.t == self.spec.get("hang_at"):
            time.sleep(60)
        if self.t == self.spec.get("raise_at"):
            raise RuntimeError("this game is broken")
        return self.state(f"Room {self.spec['name']}, step {self.t}: you tried '{action[:40]}'.",
                          won=self.t == self.spec.get("win_at"))


def make_game(spec):
    return EchoGame(spec)
