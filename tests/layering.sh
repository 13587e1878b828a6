#!/usr/bin/env bash
# The folders of src/loom are layers (docs/development.md): a file may include
# only its own folder and the folders below it. Fails naming each include
# that reaches up or sideways.
set -euo pipefail
cd "$(dirname "$0")/../src/loom"
declare -A allowed=(
  [core]="core"
  [kernels]="core kernels"
  [comm]="core kernels comm"
  [nn]="core kernels nn"
  [model]="core kernels nn model"
  [optim]="core kernels nn optim"
  [parallel]="core kernels comm nn model optim parallel"
  [io]="core io"
  [data]="core io data"
  [checkpoint]="core kernels nn model optim io checkpoint"
  [infer]="core kernels nn model infer"
  [profile]="core kernels io profile"
  [report]="core io report"
  [plan]="core kernels comm nn model optim parallel io plan"
  [train]="core kernels comm nn model optim parallel io data checkpoint infer profile report plan train"
)
bad=0
for dir in */; do
  dir=${dir%/}
  [[ -n ${allowed[$dir]:-} ]] || { echo "layering: folder $dir has no layer (add it to tests/layering.sh and docs/development.md)"; bad=1; continue; }
  while IFS=: read -r file _ inc; do
    target=$(sed -E 's#.*"loom/([a-z_]+)/.*#\1#' <<<"$inc")
    [[ " ${allowed[$dir]} " == *" $target "* ]] ||
      { echo "layering: $file includes loom/$target/ (a $dir file may include: ${allowed[$dir]})"; bad=1; }
  done < <(grep -rn '#include "loom/' "$dir" || true)
done
# Inside the layers: a backend's own kernels are reached through the backend
# table (kernels/backend.h); only the code that makes a CPU backend or
# measures its GEMMs (train, profile) names kernels/cpu, and compute threads
# live in the CPU backend (and the host pool of core/threads).
while IFS=: read -r file _ _; do
  case $file in kernels/* | train/* | profile/*) ;; *)
    echo "layering: $file includes loom/kernels/cpu/ (layers reach kernels through kernels/backend.h)"
    bad=1 ;;
  esac
done < <(grep -rn '#include "loom/kernels/cpu/' . | sed 's#^\./##' || true)
while IFS=: read -r file _ _; do
  case $file in kernels/cpu/* | core/threads.cc) ;; *)
    echo "layering: $file has an OpenMP loop (compute belongs to a backend, kernels/cpu)"
    bad=1 ;;
  esac
done < <(grep -rn '#pragma omp' . | sed 's#^\./##' || true)
((bad == 0)) && echo "layering: every include goes down"
exit $bad
