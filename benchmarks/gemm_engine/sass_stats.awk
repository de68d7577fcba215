# Per kernel of `cuobjdump -sass`: the highest register named, and how many of
# each instruction that tells the sm90 GEMM's path (HGMMA/QGMMA: wgmma; UTMALDG
# (.MC: multicast) / UTMASTG: TMA loads and stores; UCGABAR: cluster barrier;
# USETMAXREG; MEMBAR; LDL/STL: local memory, which should be 0; HMMA: the
# mma.sync path, which should be absent).
/Function :/ { f = $3 }
/\/\*[0-9a-f]+\*\// {
  for (i = 1; i <= NF; i++) {
    op = $i
    if (op ~ /^(HGMMA|QGMMA|HMMA|UTMALDG|UTMASTG|LDL|STL|USETMAXREG|UCGABAR_ARV|MEMBAR)/) {
      split(op, a, "."); k = a[1]; if (op ~ /MULTICAST/) k = k ".MC"
      n[f, k]++; keys[k] = 1; seen[f] = 1
      break
    }
  }
  line = $0
  while (match(line, /[^U]R[0-9]+/)) {
    r = substr(line, RSTART + 2, RLENGTH - 2) + 0; if (r > maxr[f]) maxr[f] = r
    line = substr(line, RSTART + RLENGTH)
  }
}
END {
  for (f in seen) {
    printf "%s  R%d", f, maxr[f]
    for (k in keys) if (n[f, k]) printf "  %s %d", k, n[f, k]
    printf "\n"
  }
}
