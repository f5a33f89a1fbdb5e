#!/usr/bin/env bash
# System packages the multi-node tests use: sshd for the loopback nodes, pdsh for the pdsh runner,
# rsync for `crew sync` (which falls back to tar without it), Slurm with munge for the private
# one-machine Slurm cluster (tests/slurmcluster.py) of the slurm launcher's tests, and OpenMPI and MPICH
# (side by side: mpirun.openmpi, mpirun.mpich) for the MPI launchers' tests.
# Installs them when missing and this user may (root, or password-less sudo); otherwise says so,
# and the tests that need them are skipped with that reason. Each group installs on its own, so one
# that apt cannot install does not hold back the others.
set -u
missing=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v pdsh >/dev/null || missing+=(pdsh)
command -v rsync >/dev/null || missing+=(rsync)
slurm=()
[ -x /usr/sbin/slurmctld ] || slurm+=(slurmctld)
[ -x /usr/sbin/slurmd ] || slurm+=(slurmd)
[ -x /usr/sbin/munged ] || slurm+=(munge)
command -v srun >/dev/null || slurm+=(slurm-client)
mpi=()
command -v mpirun.openmpi >/dev/null || mpi+=(openmpi-bin)
command -v mpirun.mpich >/dev/null || mpi+=(mpich)
[ ${#missing[@]} -eq 0 ] && [ ${#slurm[@]} -eq 0 ] && [ ${#mpi[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "system-deps: cannot install ${missing[*]} ${slurm[*]} ${mpi[*]} (not root, no password-less sudo); the ssh/pdsh/rsync/slurm/mpi tests will be skipped." >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >/dev/null || echo "system-deps: apt-get update failed; trying the install anyway." >&2
install() {  # install GROUP-NAME PACKAGE...: never fails the build
  local group=$1; shift
  [ $# -eq 0 ] && return 0
  echo "system-deps: installing $*" >&2
  $sudo apt-get install -y -q --no-install-recommends "$@" >/dev/null \
    || echo "system-deps: apt-get could not install $*; the $group tests will be skipped." >&2
}
install ssh/pdsh/rsync "${missing[@]}"
install slurm "${slurm[@]}"
install mpi "${mpi[@]}"
exit 0
