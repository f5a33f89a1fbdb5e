"""Before anything starts: hostfile, Slurm allocation or Accelerate config -> hosts -> Plan -> job spec."""
