#!/bin/bash
for w in single poisson burst; do R=3; [ $w != single ] && R=2; PB=0; [ $w = poisson ] && PB=10; [ $w = burst ] && PB=20; PORT_BASE=$PB O=/work/scratch/s11/ab2-di-$w SIDES="url di" WL=$w ROUNDS=$R /work/scratch/s11/ab_url.sh; done
