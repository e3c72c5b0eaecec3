for i in $(seq 1 30); do
  d=$(python -c "import random; print(round(random.uniform(0.3, 5), 2))")
  switchboard serve --port 18555 --data-dir d > run.log 2>&1 &
  pid=$!; sleep $d; kill -INT $pid; wait $pid; rc=$?
  echo "$d rc=$rc $(tail -1 run.log | cut -c1-150)"
  if [ $rc -ne 130 ] && [ $rc -ne 0 ]; then cp run.log bad_$i.log; fi
done
