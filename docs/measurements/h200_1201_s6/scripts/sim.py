"""Discrete sim of the multiturn bench's scheduling: rows, FIFO queue, tools, one-step-behind reads."""
import random, sys, collections
def sim(T=512, R=256, turns=4, new=256, tool_ms=50.0, step_ms=2.2, staggered=True, seed=3, policy="fifo"):
    rng = random.Random(seed)
    lengths = []
    for _ in range(T):
        if staggered:
            cuts = sorted(rng.sample(range(1, new), turns - 1))
            lengths.append([b - a for a, b in zip([0, *cuts], [*cuts, new])])
        else:
            lengths.append([new // turns] * turns)
    queue = collections.deque((i, 0) for i in range(T))
    rows = {}  # traj -> remaining tokens
    tool = []  # (ready_time, traj, turn)
    t, steps, row_steps, done = 0.0, 0, 0, 0
    turn_of = [0] * T
    trace = []
    while done < T:
        # tools back
        back = sorted([x for x in tool if x[0] <= t]); tool = [x for x in tool if x[0] > t]
        for _, i, k in back:
            queue.append((i, k))
        while queue and len(rows) < R:
            i, k = queue.popleft() if policy == "fifo" else queue.pop()
            rows[i] = lengths[i][k] + 1  # +1: the discarded step after finishing (read one behind)
            turn_of[i] = k
        if not rows:
            t = min(x[0] for x in tool); continue
        steps += 1; row_steps += len(rows); trace.append(len(rows))
        t += step_ms
        for i in list(rows):
            rows[i] -= 1
            if rows[i] == 0:
                del rows[i]
                k = turn_of[i]
                if k + 1 < turns:
                    tool.append((t + tool_ms, i, k + 1))
                else:
                    done += 1
    return steps, row_steps / steps, t, trace
for stag in (False, True):
    s, r, t, tr = sim(staggered=stag)
    print("staggered" if stag else "lockstep", s, round(r, 1), round(t))
    n = len(tr); print("  rows by decile:", [round(sum(tr[i*n//10:(i+1)*n//10])/max(1,(n//10)),0) for i in range(10)])
