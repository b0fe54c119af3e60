# Sourced by the scripts: the environment mpirun needs on these machines.
# As root, OpenMPI refuses to start without these two.
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores is normal on small machines; OpenMPI then yields while waiting.
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
# One-line panics if a bug slips through; the binary prints its own one-line errors.
export RUST_BACKTRACE=${MPIFLOW_RUST_BACKTRACE:-0}
