#!/bin/sh
# The official redis image's entry point, in short: flags alone are redis-server's, and
# redis-server started as root gets /data and drops to the redis user.
set -e
case "$1" in
  -*|*.conf) set -- redis-server "$@" ;;
esac
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
