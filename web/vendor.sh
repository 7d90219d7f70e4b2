#!/usr/bin/env bash
# Fetch the dashboard's and the API docs' front-end files again from the npm registry and check their digests
# against web/static/vendor/SHA256SUMS (see web/static/vendor/README.md). Needs npm.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
vendor="$here/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent uplot@1.6.32 htmx.org@2.0.11 htmx-ext-sse@2.2.4 swagger-ui-dist@5.35.0 redoc@2.5.4 >/dev/null
for tarball in *.tgz; do mkdir "${tarball%.tgz}" && tar xzf "$tarball" -C "${tarball%.tgz}"; done
mkdir -p "$vendor/uplot" "$vendor/htmx" "$vendor/htmx-ext-sse" "$vendor/swagger-ui" "$vendor/redoc"
cp uplot-1.6.32/package/dist/uPlot.iife.min.js uplot-1.6.32/package/dist/uPlot.min.css uplot-1.6.32/package/LICENSE "$vendor/uplot/"
cp htmx.org-2.0.11/package/dist/htmx.min.js htmx.org-2.0.11/package/LICENSE "$vendor/htmx/"
cp htmx-ext-sse-2.2.4/package/dist/sse.min.js htmx-ext-sse-2.2.4/package/LICENSE "$vendor/htmx-ext-sse/"
swagger=swagger-ui-dist-5.35.0/package
cp "$swagger/swagger-ui-bundle.js" "$swagger/swagger-ui-bundle.js.LICENSE.txt" "$swagger/swagger-ui.css" \
  "$swagger/favicon-32x32.png" "$swagger/LICENSE" "$swagger/NOTICE" "$vendor/swagger-ui/"
cp redoc-2.5.4/package/bundles/redoc.standalone.js redoc-2.5.4/package/bundles/redoc.standalone.js.LICENSE.txt \
  redoc-2.5.4/package/LICENSE "$vendor/redoc/"
cd "$vendor" && sha256sum --check --quiet SHA256SUMS && echo "vendored files match SHA256SUMS"
