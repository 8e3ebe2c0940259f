#!/bin/sh
# OpenMPI's launcher agent for the multi-host tests (scripts/multihost-test.sh): called
# the way mpirun calls ssh, `multihost-agent.sh [ssh options] HOST COMMAND...`, it runs
# COMMAND in the network namespace named HOST, with its own hostname (a UTS namespace),
# so that every "host" of the test has its own network stack and name, as a real
# machine would. Nothing here is needed on a real cluster, where ssh does this job.
while [ $# -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
exec ip netns exec "$host" unshare --uts sh -c "hostname '$host' && $*"
