#!/bin/bash
# Alternating fresh-process starts of the commit before the start-up changes (old: a worktree at /tmp/old, made
# with `git worktree add /tmp/old 6e7e178`) and this checkout (new), wall clock, caches warm (run each once first).
cd /work/main
for i in 1 2 3; do
  for args in "" "--method ar" "--compile off"; do
    for v in old new; do
      if [ $v = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
      s=$(date +%s.%N)
      PYTHONPATH=$P .venv/bin/python -m treeflash.cli generate "What is 2+2?" --max-new-tokens 1 $args >/dev/null 2>&1
      e=$(date +%s.%N)
      echo "$v|$args|$(echo "$e - $s" | bc)"
    done
  done
done
