#!/bin/bash
# usage: bash runner.sh COMMANDS ; each line: NAME TIMEOUT COMMAND...
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
cp "$1" $OUT/commands.txt
mkdir -p /tmp/r
while read -r name to cmd; do
  [ -z "$name" ] && continue
  echo "$name $(date)" >> $OUT/steps.txt
  timeout "$to" bash -c "$cmd" > $OUT/$name.log 2>&1; rc=$?
  echo "$name rc=$rc $(date)" >> $OUT/steps.txt
  [ -d /tmp/r/$name ] && rm -f /tmp/r/$name/hlo_* && cp -r /tmp/r/$name $OUT/
  tail -5 $OUT/$name.log
done < "$1"
