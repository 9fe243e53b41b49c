package bypass

import "testing"

// The part of a command line a program is learned by: the command and the
// arguments up to the first that is not an option.
func TestProgramArgs(t *testing.T) {
	for _, tc := range []struct{ cmdline, want string }{
		{"python3\x00/srv/app.py\x00--port\x008080\x00", "python3 /srv/app.py"},
		{"python3\x00-u\x00/srv/app.py\x00", "python3 -u /srv/app.py"},
		{"python3\x00-m\x00http.server\x008000\x00", "python3 -m http.server"},
		{"java\x00-Xmx1g\x00-jar\x00app.jar\x00--spring.profiles=x\x00", "java -Xmx1g -jar app.jar"},
		{"haproxy\x00-db\x00-f\x00/etc/haproxy.cfg\x00", "haproxy -db -f /etc/haproxy.cfg"},
		{"nginx: worker process\x00", "nginx: worker process"},
		{"sleep\x00", "sleep"},
		{"", ""},
	} {
		if got := showArgs(programArgs([]byte(tc.cmdline))); got != tc.want {
			t.Errorf("%q: %q, want %q", tc.cmdline, got, tc.want)
		}
	}
	if argsHash([]byte("python3\x00a.py\x001\x00")) != argsHash([]byte("python3\x00a.py\x002\x00")) {
		t.Error("two runs of one script with other arguments hash apart")
	}
	if argsHash([]byte("python3\x00a.py\x00")) == argsHash([]byte("python3\x00b.py\x00")) {
		t.Error("two scripts of one interpreter hash alike")
	}
}
