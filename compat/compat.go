// Package compat runs real programs from Debian's packages through shunt
// bypass and checks what they deliver, byte for byte: the proof that
// software people run behaves through shunt as over TCP, or stays on TCP.
// Its tests are the correctness half of docs/COMPATIBILITY.md.
package compat
