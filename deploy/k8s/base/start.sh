#!/bin/sh
# Every h3serve container's entry point: `start.sh SERVICE`. The deployment file from the ConfigMap gets the values
# that live in Secrets or are known only in the pod (@STAGE_TOKEN@, @STORE_URL@; @LEADER@: a LeaderWorkerSet's leader
# address), written where only this container reads it, then the service replaces this shell.
set -eu
umask 077
sed -e "s|@STAGE_TOKEN@|${STAGE_TOKEN:-}|g" \
    -e "s|@STORE_URL@|${STORE_URL:-}|g" \
    -e "s|@LEADER@|${LWS_LEADER_ADDRESS:-}|g" \
    /etc/h3serve/deploy.toml > /run/h3serve/deploy.toml
exec h3serve serve "$1" --config /run/h3serve/deploy.toml
