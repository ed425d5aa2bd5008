"""jobs/train_dp.py run as a user would, for the launcher-tier tests of spmd.train (imported by them)."""

from tests.support import clean_env, run


def train_job(name, cmd, size, args, final):
    """Run cmd + args, the final parameters saved to final; assert it ended well on every rank; return stdout."""
    result = run(cmd + args + ["--save-final", final], 150, env=clean_env(OMP_NUM_THREADS=1), what=f"train_dp {name}")
    ranks = "rank" if size == 1 else "ranks"
    assert result.returncode == 0 and f"parameters identical on {size} {ranks}" in result.stdout, (
        f"{name}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def once_each(out, run):
    """Return train(name): run(name, out) the first time name is asked for, its result kept after."""
    done = {}

    def train(name):
        if name not in done:
            done[name] = run(name, out)
        return done[name]

    return train
